"""Summarising benchmark runs: per-method metrics and the markdown tables of ``dspark-hf bench``."""

from __future__ import annotations

from ..decoding.rounds import DSparkGenerationStats
from .runner import MODES, RunRecord, default_methods


def merge_stats(all_stats: list[DSparkGenerationStats]) -> DSparkGenerationStats:
    """One statistics object holding the rounds of several generations (same block size)."""
    merged = DSparkGenerationStats(block_size=all_stats[0].block_size)
    for stats in all_stats:
        merged.rounds.extend(stats.rounds)
    return merged


def summarize(records: list[RunRecord], block_size: int = 7) -> list[dict]:
    """One row per (dataset, mode, method) with the reported metrics (see the module docstring).

    Speedup is tokens/s over the ``target`` method's tokens/s on the same dataset and mode. Decode speedup is
    the same with each run's time less the target's own prefill of its prompt (timed beside the runs): sampled
    runs stop at different lengths, and a run that stops earlier spreads the same prefill over fewer tokens.
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
        decode = sum(r.seconds - r.target_prefill_seconds for r in done) if done and all(
            r.target_prefill_seconds is not None for r in done) else None
        row["decode_tokens_per_s"] = tokens / decode if decode and decode > 0 else None
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
    for column, base_method, rate in (("speedup", "target", "tokens_per_s"),
                                      ("speedup_vs_stock", "target-stock", "tokens_per_s"),
                                      ("decode_speedup", "target", "decode_tokens_per_s")):
        baseline = {(r["dataset"], r["mode"]): r[rate] for r in rows if r["method"] == base_method}
        for row in rows:
            base = baseline.get((row["dataset"], row["mode"]))
            row[column] = row[rate] / base if base and row[rate] else None
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
        "| dataset | mode | method | tok/s | speedup | decode speedup | vs stock | tau | verify eff. | drafted | lookup | mean verified | "
        "ms/round verify / draft / serial / sched / other | overhead | same as target |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in rows:
        split = row.get("ms_per_round")
        split_text = " / ".join(f"{split[k]:.1f}" for k in ("target_verify", "draft_forward", "serial_loop",
                                                             "scheduler", "other")) if split else "-"
        same = {True: "yes", False: "**NO**", None: "-"}[row["identical_to_target"]]
        if row["errors"] and row["tokens_per_s"] is None:
            lines.append(f"| {row['dataset']} | {row['mode']} | {row['method']} | error: {row['errors'][0][:60]} "
                         "| | | | | | | | | | | |")
            continue
        lines.append(
            f"| {row['dataset']} | {row['mode']} | {row['method']} | {_fmt(row['tokens_per_s'], 1)} | "
            f"{_fmt(row['speedup'], 2, 'x')} | {_fmt(row.get('decode_speedup'), 2, 'x')} | "
            f"{_fmt(row.get('speedup_vs_stock'), 2, 'x')} | {_fmt(row.get('tau'))} | {_fmt(row.get('verify_efficiency'))} | "
            f"{_fmt(None if row.get('drafted_fraction') is None else 100 * row['drafted_fraction'], 0, '%')} | "
            f"{_fmt(None if row.get('source_shares') is None else 100 * row['source_shares'].get('lookup', 0.0), 0, '%')} | "
            f"{_fmt(row.get('mean_scheduled_length'))} | {split_text} | "
            f"{_fmt(None if row.get('overhead_share') is None else 100 * row['overhead_share'], 1, '%')} | {same} |"
        )
    return "\n".join(lines) + "\n"


def batch_sweep_table(rows: list[dict]) -> str:
    """The R sweep as a markdown table (one line per R and mode)."""
    lines = ["| R | mode | prompts | target batched tok/s | DSpark batched tok/s | vs batched target | first call | limit | "
             "limit (padded) | tau per row | verified / padded tokens per round | drafted | drift | same as target |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        same = "n/a (sampled)" if r["identical_to_target"] is None else ("yes" if r["identical_to_target"] else "**NO**")
        lines.append(f"| {r['batch_size']} | {r['mode']} | {r['prompts']} | {r['target_batched_tokens_per_s']:.1f} | "
                     f"{r['dspark_batched_tokens_per_s']:.1f} | {r['speedup_vs_batched_target']:.2f}x | "
                     f"{_first_call_cell(r)} | {r['limit']:.2f}x | {r['limit_padded']:.2f}x | {r['tau_batch']:.2f} | "
                     f"{r['mean_verified_tokens_per_round']:.1f} / {r['mean_padded_tokens_per_round']:.1f} | "
                     f"{100 * r['drafted_share']:.0f}% | x{r['cost_model_drift']:.2f} | {same} |")
    return "\n".join(lines) + "\n"


def _first_call_cell(row: dict) -> str:
    speedup = row.get("first_call_speedup")  # sweeps written before it was measured lack it
    return "n/a" if speedup is None else f"{speedup:.2f}x ({row['first_call_seconds']:.1f} s)"


__all__ = ["batch_sweep_table", "markdown_table", "merge_stats", "summarize"]
