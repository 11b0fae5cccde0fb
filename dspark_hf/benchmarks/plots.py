"""The PNG plots of ``dspark-hf bench`` (need matplotlib; skipped with a warning without it)."""

from __future__ import annotations

from pathlib import Path

from transformers.utils import logging

logger = logging.get_logger(__name__)


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or ``None`` (with a warning) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; skipping the plots (pip install matplotlib).")
        return None
    return plt


def write_plots(rows: list[dict], sps_record: dict | None, out_dir: Path,
                live_sps: list[float] | None = None) -> list[Path]:
    """speedup.png, acceptance.png and sps.png (needs matplotlib; returns the files written)."""
    plt = _pyplot()
    if plt is None:
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
    if ax.get_legend_handles_labels()[0]:  # no curve when neither fixed-7 method ran
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
        prior = "cached curve of earlier calls" if sps_record.get("estimated") else "monotone fit (prior)"
        ax.plot(sizes, [1e3 / r for r in sps_record["sps"]], "-", label=prior)
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


def plot_batch_sweep(rows: list[dict], out_dir: Path) -> Path | None:
    """batch_sweep.png: DSpark's speed-up over the target's own batched generation against R, per
    mode, with the limit the measured step curve allows (``None`` without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode]
        sizes = [r["batch_size"] for r in mine]
        line, = ax.plot(sizes, [r["speedup_vs_batched_target"] for r in mine], marker="o", label=f"{mode}: measured")
        ax.plot(sizes, [r["limit_padded"] for r in mine], linestyle="--", color=line.get_color(),
                label=f"{mode}: limit (padded forward)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size R")
    ax.set_ylabel("DSpark / target batched (tokens/s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "batch_sweep.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["plot_batch_sweep", "write_plots"]
