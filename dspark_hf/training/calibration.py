"""Sequential Temperature Scaling (paper section 3.2.1) of the confidence head.

The scheduler multiplies confidences (``s_k = c_1 ... c_k``), so what must be calibrated is the
cumulative product. STS fits one temperature per position, left to right: for position k a 1-D
grid search picks the ``T_k`` that minimises the expected calibration error (ECE) of
``prod_{i<=k} sigmoid(z_i / T_i)`` against the observed survival, with ``T_1..T_{k-1}`` fixed.

Observed survival on held-out data is ``prod_{i<=k} a_i`` with ``a_i = 1 - TV(p_d, p_t)/2`` the
exact acceptance probability of position i (teacher forcing), i.e. ECE is measured against
expected rather than sampled outcomes, which removes sampling noise from the labels.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..model.draft_vocab import scatter_to_vocab
from ..model.heads import calibrated_confidences
from ..model.modeling_dspark import DSparkDraftModel
from .target_loading import target_head
from .trainer import draft_block_outputs, sample_anchors, serial_logits_teacher_forced

DEFAULT_GRID = torch.logspace(-1.0, 1.0, 81)  # temperatures 0.1 .. 10


def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor, num_bins: int = 10) -> float:
    """Equal-width-bin ECE: sum over bins of (bin share) * |mean predicted - mean observed|."""
    bins = torch.clamp((predicted * num_bins).long(), max=num_bins - 1)
    total = predicted.numel()
    error = 0.0
    for b in range(num_bins):
        in_bin = bins == b
        count = int(in_bin.sum())
        if count:
            error += count / total * abs(float(predicted[in_bin].mean() - observed[in_bin].mean()))
    return error


def survival(confidence_logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """Cumulative products of ``sigmoid(z / T)`` along positions, (N, gamma)."""
    return torch.cumprod(calibrated_confidences(confidence_logits, temperatures), dim=-1)


def sequential_temperature_scaling(
    confidence_logits: torch.Tensor, acceptance: torch.Tensor, grid: torch.Tensor = DEFAULT_GRID, num_bins: int = 10
) -> list[float]:
    """Per-position temperatures, fitted left to right (earlier positions fixed)."""
    gamma = confidence_logits.shape[1]
    observed = torch.cumprod(acceptance, dim=-1)
    temperatures = torch.ones(gamma)
    for k in range(gamma):
        best_t, best_error = 1.0, float("inf")
        for t in grid.tolist():
            temperatures[k] = t
            predicted = survival(confidence_logits[:, : k + 1], temperatures[: k + 1])[:, k]
            error = expected_calibration_error(predicted, observed[:, k], num_bins)
            if error < best_error:
                best_t, best_error = t, error
        temperatures[k] = best_t
    return temperatures.tolist()


def per_position_ece(confidence_logits, acceptance, temperatures=None, num_bins: int = 10) -> list[float]:
    predicted = survival(confidence_logits, None if temperatures is None else torch.tensor(temperatures))
    observed = torch.cumprod(acceptance, dim=-1)
    return [expected_calibration_error(predicted[:, k], observed[:, k], num_bins) for k in range(predicted.shape[1])]


def reliability_diagram(confidence_logits, acceptance, temperatures, path: str | Path, num_bins: int = 10) -> Path:
    """PNG: mean observed vs mean predicted survival per bin, before and after calibration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    observed = torch.cumprod(acceptance, dim=-1).flatten()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for ax, temps, title in ((axes[0], None, "before"), (axes[1], temperatures, "after STS")):
        predicted = survival(confidence_logits, None if temps is None else torch.tensor(temps)).flatten()
        bins = torch.clamp((predicted * num_bins).long(), max=num_bins - 1)
        xs, ys = [], []
        for b in range(num_bins):
            m = bins == b
            if m.any():
                xs.append(float(predicted[m].mean()))
                ys.append(float(observed[m].mean()))
        ax.plot([0, 1], [0, 1], "--", color="gray")
        ax.plot(xs, ys, "o-")
        ax.set_title(f"prefix survival, {title}")
        ax.set_xlabel("predicted c_1...c_k")
    axes[0].set_ylabel("observed survival (held-out)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@torch.no_grad()
def collect_confidences(draft: DSparkDraftModel, target_head, items: list[dict], anchors_per_sequence: int = 32,
                        seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced held-out statistics: (confidence logits, acceptance 1 - TV/2, argmax match), each (N, gamma)."""
    generator = torch.Generator().manual_seed(seed)
    conf, accept, match = [], [], []
    gamma = draft.config.block_size
    for item in items:
        anchors = sample_anchors(item["ids"].numel(), item["answer_start"], anchors_per_sequence, gamma, generator)
        if anchors.numel() == 0:
            continue
        base, hidden, previous, labels = draft_block_outputs(draft, item, anchors)
        logits, confidence = serial_logits_teacher_forced(draft, base, hidden, previous)
        if draft.draft_vocab_ids is not None:  # q = 0 outside a reduced draft vocabulary
            logits = scatter_to_vocab(logits, draft.draft_vocab_ids, draft.config.vocab_size, float("-inf"))
        final = item["final"].to(hidden.device, torch.float32)
        positions = anchors[:, None] + torch.arange(gamma) + 1
        p_target = torch.softmax(target_head(final[positions - 1]).float(), -1)
        p_draft = torch.softmax(logits.float(), -1)
        accept.append(1 - 0.5 * (p_draft - p_target).abs().sum(-1))
        match.append((logits.argmax(-1) == p_target.argmax(-1)).float())
        if confidence is not None:
            conf.append(confidence.float())
    return (torch.cat(conf) if conf else None), torch.cat(accept), torch.cat(match)


def calibrate_draft(draft, target, held_out_items: list[dict], output_dir: Path) -> dict:
    """Fits STS temperatures on held-out sequences, stores them in ``draft.config`` and writes
    ``calibration.json`` (per-position ECE before/after) and ``reliability.png`` to ``output_dir``."""
    draft.config.confidence_temperatures = None
    logits, acceptance, _ = collect_confidences(draft, target_head(target), held_out_items)
    temperatures = sequential_temperature_scaling(logits, acceptance)
    report = {
        "temperatures": temperatures,
        "ece_before": per_position_ece(logits, acceptance),
        "ece_after": per_position_ece(logits, acceptance, temperatures),
        "num_blocks": int(logits.shape[0]),
    }
    draft.config.confidence_temperatures = temperatures
    (output_dir / "calibration.json").write_text(json.dumps(report, indent=2))
    reliability_diagram(logits, acceptance, temperatures, output_dir / "reliability.png")
    return report


__all__ = ["collect_confidences", "expected_calibration_error", "sequential_temperature_scaling", "per_position_ece",
           "reliability_diagram", "calibrate_draft", "survival"]
