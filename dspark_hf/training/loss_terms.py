"""How the paper's loss weighs its per-position terms, written once for both of its forms.

:func:`dspark_hf.training.trainer.dspark_loss` (full vocabulary) and
:func:`dspark_hf.training.draft_vocab_training.reduced_vocab_loss` (a reduced draft vocabulary)
compute cross-entropy and total variation differently, then combine them the same way; the trainer
imports the reduced form, so the shared step lives here rather than in either of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


CE_TARGETS = ("label", "distribution")  # what the cross-entropy term aims at (TrainingConfig.ce_target)


def check_ce_target(ce_target: str) -> None:
    """Refuses a ``ce_target`` that is not one of :data:`CE_TARGETS`."""
    if ce_target not in CE_TARGETS:
        raise ValueError(f"ce_target={ce_target!r}: choose 'label' (cross-entropy to the sequence's next token, the "
                         "paper's) or 'distribution' (to the target's whole next-token distribution).")


def combine_loss_terms(
    ce: torch.Tensor,
    tv: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    weights: torch.Tensor,
    *,
    ce_weight: float,
    tv_weight: float,
    conf_weight: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted loss from per-position cross-entropy and total variation, both (A, gamma).

    The confidence head (when ``confidence_logits`` is given) learns the expected acceptance
    ``1 - tv/2`` by binary cross-entropy; the target is detached so that this term trains the head
    only, not the draft's distribution. ``weights`` (gamma,) weigh the positions of a block.

    Returns ``(loss, bce, acceptance)``: the mean over blocks of the position-weighted sum, the
    per-position BCE (zeros without a confidence head) and the per-position acceptance, (A, gamma).
    """
    acceptance = 1.0 - 0.5 * tv
    total = ce_weight * ce + tv_weight * tv
    bce = torch.zeros_like(tv)
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(
            confidence_logits.float(), acceptance.detach().clamp(0.0, 1.0), reduction="none"
        )
        total = total + conf_weight * bce
    loss = (total * weights).sum(-1).mean()
    return loss, bce, acceptance
