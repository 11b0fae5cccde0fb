"""The last stage of ``dspark-hf train``: what the new draft is worth, measured on held-out answers.

The prompts are those of the run's own held-out answers (the calibration set, which training never
saw), grouped by their source (ShareGPT questions, maths, code, or the prompts file). Greedy, on the
prepared target (``optimize_for_cpu``), interleaved prompt by prompt with the order of methods
rotating (:func:`dspark_hf.benchmarks.runner.run_benchmark`): the target alone, DSpark with the new
draft (default settings: the scheduler and context lookup), and prompt lookup, transformers'
n-gram drafting. Every DSpark output is checked identical to the target's.
"""

from __future__ import annotations

import copy
import dataclasses

from transformers import PreTrainedModel

from ..cpu_engine import prepare_for_cpu
from ..model.modeling_dspark import DSparkDraftModel

METHODS = ("target", "dspark", "prompt-lookup")


def held_out_prompts(records: list[dict], per_source: int) -> dict[str, list[list[int]]]:
    """The first ``per_source`` prompts of each source among ``records``, as token id lists."""
    prompts: dict[str, list[list[int]]] = {}
    for record in records:
        chosen = prompts.setdefault(record.get("source", "prompts"), [])
        if len(chosen) < per_source:
            chosen.append(list(record["prompt_ids"]))
    return prompts


def measure_draft(target: PreTrainedModel, draft: DSparkDraftModel, prompts: dict[str, list[list[int]]], *,
                  max_new_tokens: int, prepare: bool = True, progress: bool = True) -> dict:
    """Runs the three methods greedily on ``prompts`` (per dataset) and returns a report: per dataset and
    over all, DSpark's and prompt lookup's speed-up over the target, DSpark over prompt lookup, DSpark's
    τ (tokens per target forward) and whether every output equalled the target's.

    ``prepare`` applies the CPU engine's ``optimize_for_cpu`` to a copy of the draft on the CPU
    (:func:`dspark_hf.cpu_engine.prepare_for_cpu`; the target is expected prepared already, as the pipeline leaves it)."""
    from ..benchmarks.runner import BenchMethod, run_benchmark
    from ..benchmarks.summary import summarize

    draft = copy.deepcopy(draft).eval()
    if prepare and target.device.type == "cpu":
        prepare_for_cpu(draft)
    draft.bind_target(target)  # a reduced head is built here, not inside the first timed call
    methods = [BenchMethod("target", "target"), BenchMethod("dspark", "dspark", "dspark", "scheduler"),
               BenchMethod("prompt-lookup", "prompt-lookup")]
    records, _ = run_benchmark(target, {"dspark": draft}, prompts, methods, modes=("greedy",),
                               max_new_tokens=max_new_tokens, progress=progress)
    every = [dataclasses.replace(r, dataset="all") for r in records]
    rows = {(row["dataset"], row["method"]): row
            for row in summarize(records + every, block_size=draft.config.block_size)}
    report = {"max_new_tokens": max_new_tokens, "datasets": {}}
    for dataset in prompts:
        report["datasets"][dataset] = _figures(rows, dataset, len(prompts[dataset]))
    report["all"] = _figures(rows, "all", sum(len(p) for p in prompts.values()))
    return report


def _figures(rows: dict, dataset: str, prompts: int) -> dict:
    """One dataset's report from :func:`~dspark_hf.benchmarks.summary.summarize`'s rows."""
    dspark, lookup = rows.get((dataset, "dspark"), {}), rows.get((dataset, "prompt-lookup"), {})
    rate = {m: rows.get((dataset, m), {}).get("tokens_per_s") for m in METHODS}
    return {"prompts": prompts, "tokens_per_s": rate, "speedup": dspark.get("speedup"),
            "prompt_lookup_speedup": lookup.get("speedup"),
            "vs_prompt_lookup": rate["dspark"] / rate["prompt-lookup"] if rate["dspark"] and rate["prompt-lookup"]
            else None,
            "tau": dspark.get("tau"), "identical": dspark.get("identical_to_target") is True,
            "errors": sorted({e for m in METHODS for e in rows.get((dataset, m), {}).get("errors", [])})}


def describe(report: dict) -> str:
    """The report as the command prints it and the card lists it."""
    def fmt(value, suffix="x"):
        return "-" if value is None else f"{value:.2f}{suffix}"

    lines = [f"Greedy on held-out prompts ({report['max_new_tokens']} new tokens), interleaved: "
             "DSpark vs target | prompt lookup vs target | DSpark vs prompt lookup | tau | identical"]
    for name, row in list(report["datasets"].items()) + [("all", report["all"])]:
        lines.append(f"  {name} ({row['prompts']} prompts): {fmt(row['speedup'])} | {fmt(row['prompt_lookup_speedup'])} | "
                     f"{fmt(row['vs_prompt_lookup'])} | {fmt(row['tau'], '')} | {'yes' if row['identical'] else 'NO'}"
                     + (f" | errors: {row['errors'][0][:80]}" if row["errors"] else ""))
    return "\n".join(lines)


__all__ = ["describe", "held_out_prompts", "measure_draft"]
