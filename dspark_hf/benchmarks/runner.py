"""Running the benchmark's methods: what each method is, and the interleaved run over prompts.

Every method runs on the same prompts in the same process, interleaved prompt by prompt (the
order of methods rotates from one prompt to the next), so drift of the machine hits all alike.
:mod:`dspark_hf.benchmarks.bench_cli` describes the methods and what is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.policies import FixedLengthPolicy, ThresholdPolicy
from ..decoding.rounds import RoundStats
from ..scheduling.shared_cost import shared_cost_model

MODES = ("greedy", "sample")


@dataclass(frozen=True)
class BenchMethod:
    """One way of generating. ``kind``: "target", "target-stock", "dspark", "prompt-lookup" or "early-exit".

    For "dspark", ``draft`` names an entry of the drafts passed to :func:`run_benchmark` and
    ``policy`` is "scheduler", ("fixed", k) or ("threshold", t).
    """

    name: str
    kind: str
    draft: str | None = None
    policy: str | tuple | None = None
    lookup: bool = True  # DSpark: context lookup as a second draft source (its default)


def default_methods(dspark: str = "dspark", dflash: str | None = "dflash", *, quick: bool = False,
                    candidate: str | None = None) -> list[BenchMethod]:
    """The issue's method list (a shorter one with ``quick``); ``candidate`` names a second DSpark
    draft run like ``dspark-scheduler`` and ``dspark-no-lookup`` (``candidate-scheduler``, ``candidate-no-lookup``)."""
    methods = [BenchMethod("target", "target"), BenchMethod("target-stock", "target-stock"),
               BenchMethod("dspark-scheduler", "dspark", dspark, "scheduler"),
               BenchMethod("dspark-no-lookup", "dspark", dspark, "scheduler", lookup=False)]
    if candidate is not None:
        methods += [BenchMethod("candidate-scheduler", "dspark", candidate, "scheduler"),
                    BenchMethod("candidate-no-lookup", "dspark", candidate, "scheduler", lookup=False)]
    lengths = (3,) if quick else (1, 3, 7)
    methods += [BenchMethod(f"dspark-fixed-{k}", "dspark", dspark, ("fixed", k)) for k in lengths]
    if not quick:
        methods.append(BenchMethod("dspark-threshold", "dspark", dspark, ("threshold", 0.5)))
    if dflash is not None:
        methods.append(BenchMethod("dflash-fixed-7", "dspark", dflash, ("fixed", 7)))
    methods.append(BenchMethod("prompt-lookup", "prompt-lookup"))
    if not quick:
        methods.append(BenchMethod("early-exit", "early-exit"))
    return methods


@dataclass
class RunRecord:
    """One generation: a method on one prompt of one dataset in one decoding mode."""

    method: str
    dataset: str
    mode: str
    prompt_index: int
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float | None = None
    # The target's own forward over this prompt (the prefill every method starts with), timed just before the
    # methods ran on it; the rest of ``seconds`` is decoding. The stock target's for ``target-stock``.
    target_prefill_seconds: float | None = None
    rounds: list[RoundStats] | None = None  # DSpark methods only
    identical: bool | None = None  # greedy: output equals the target's
    error: str | None = None


# ------------------------------------------------------------------------------------ running
def _policy(method: BenchMethod):
    if method.policy == "scheduler":
        return None  # the default: what a user gets
    kind, value = method.policy
    return FixedLengthPolicy(value) if kind == "fixed" else ThresholdPolicy(value)


def _generate(target, stock_target, method: BenchMethod, drafts, ids, mode, max_new_tokens, early_exit_layer):
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=mode == "sample",
                  temperature=1.0, top_k=None, top_p=None)
    if method.kind == "dspark":
        draft = drafts[method.draft]
        policy = _policy(method)
        if policy is not None:
            kwargs["dspark_verify_policy"] = policy
        kwargs["assistant_model"] = draft
        if not method.lookup:
            kwargs["prompt_lookup_num_tokens"] = 0
    elif method.kind == "target-stock":
        return stock_target.generate(ids, **kwargs)
    elif method.kind == "prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    elif method.kind == "early-exit":
        kwargs["assistant_early_exit"] = early_exit_layer
    return target.generate(ids, **kwargs)


def _time_prefill(model: PreTrainedModel, ids: torch.Tensor) -> float:
    """Seconds of one forward of ``model`` over the prompt ``ids``, filling a fresh cache, as ``generate`` starts."""
    start = time.perf_counter()
    model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(config=model.config),
          use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


@torch.no_grad()
def run_benchmark(
    target: PreTrainedModel,
    drafts: dict[str, DSparkDraftModel],
    prompts: dict[str, list[list[int]]],
    methods: list[BenchMethod],
    *,
    modes: tuple[str, ...] = MODES,
    max_new_tokens: int = 256,
    seed: int = 0,
    progress: bool = True,
    stock_target: PreTrainedModel | None = None,
) -> tuple[list[RunRecord], list[float]]:
    """Runs every method on every prompt (token id lists per dataset) in every mode, interleaved.

    ``stock_target`` runs the ``target-stock`` method (the target without the CPU fast path).
    Returns the per-run records and the scheduler's SPS table at the end (the live cost model's).
    """
    block = max((d.config.block_size for d in drafts.values()), default=7)
    cost_model = shared_cost_model(target, progress=progress)
    early_exit_layer = max(1, target.config.num_hidden_layers // 3)
    # Warm-up: one short generation per method, so lazy initialisation is not timed.
    warm_ids = torch.tensor([next(iter(prompts.values()))[0]])
    for method in methods:
        try:
            _generate(target, stock_target, method, drafts, warm_ids, "greedy", 8, early_exit_layer)
        except Exception:  # reported per run below
            pass
    records: list[RunRecord] = []
    total = len(modes) * sum(len(p) for p in prompts.values()) * len(methods)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress)
    turn = 0
    for mode in modes:
        for dataset, dataset_prompts in prompts.items():
            for index, prompt_ids in enumerate(dataset_prompts):
                ids = torch.tensor([prompt_ids])
                order = methods[turn % len(methods):] + methods[: turn % len(methods)]
                turn += 1
                outputs: dict[str, list[int]] = {}
                prefill = {"target": _time_prefill(target, ids)}
                if stock_target is not None and any(m.kind == "target-stock" for m in methods):
                    prefill["target-stock"] = _time_prefill(stock_target, ids)
                for method in order:
                    record = RunRecord(method.name, dataset, mode, index)
                    record.target_prefill_seconds = prefill.get(method.kind, prefill["target"])
                    torch.manual_seed(seed + index)
                    try:
                        start = time.perf_counter()
                        out = _generate(target, stock_target, method, drafts, ids, mode, max_new_tokens,
                                        early_exit_layer)
                        record.seconds = time.perf_counter() - start
                    except Exception as error:  # e.g. early exit unsupported by this architecture
                        record.error = f"{type(error).__name__}: {error}"
                    else:
                        record.new_tokens = out.shape[1] - ids.shape[1]
                        outputs[method.name] = out[0].tolist()
                        if method.kind == "dspark":
                            stats = drafts[method.draft].last_generation_stats
                            record.rounds = list(stats.rounds)
                            record.prefill_seconds = stats.prefill_time
                    records.append(record)
                    bar.update(1)
                if mode == "greedy" and "target" in outputs:
                    for record in records[-len(order):]:
                        if record.method in outputs and record.method != "target":
                            record.identical = outputs[record.method] == outputs["target"]
    bar.close()
    return records, list(cost_model.sps(block + 1))


__all__ = ["MODES", "BenchMethod", "RunRecord", "default_methods", "run_benchmark"]
