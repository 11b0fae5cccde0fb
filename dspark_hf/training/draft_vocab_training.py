"""Training a draft with a reduced draft vocabulary (:mod:`dspark_hf.model.draft_vocab`): choosing the ids,
their coverage, the cached target log-normaliser and the exact loss on the subset.

Choice: the N most frequent tokens of the training corpus's answers (what the draft learns to
propose), plus the special ids (EOS, pad, BOS, the mask token) so that ending a sequence can be
drafted. :func:`coverage_table` reports which share of held-out answer tokens a subset holds.

Loss without the full vocabulary each step. The target's log-normaliser ``lse_t = logsumexp(
target_head(final_t))`` is computed once per position and cached with the features
(``item["target_lse"]``, float32 (L,)). Then, for the subset S of N ids,
``p_S = exp(target_logits_S - lse_t)`` is the target's exact probability of each id of S, and with
the draft's ``q`` supported on S (zero elsewhere) the L1 distance is exactly
``sum_S |q - p_S| + (1 - sum_S p_S)``: outside S only the target has mass. Cross-entropy is taken
where the label is in S and skipped (masked) elsewhere (the draft gives those tokens probability 0;
their share is reported as ``label_outside_share``). Accuracy: the argmax over S equals the label.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.utils import logging

from ..model.draft_vocab import new_cache, subset_logits
from ..model.modeling_dspark import DSparkDraftModel
from .loss_terms import check_ce_target, combine_loss_terms

logger = logging.get_logger(__name__)

COVERAGE_SIZES = (4096, 8192, 16384, 32768)
_TARGET_HEAD_CACHE = new_cache()  # gathered rows of the target's head, for its logits in training


# ------------------------------------------------------------------------------- choosing the ids
def answer_tokens(items: Iterable[dict]) -> torch.LongTensor:
    """All answer tokens of feature-cache items (``ids`` from ``answer_start`` on) or corpus records
    (``answer_ids``), concatenated."""
    parts = []
    for item in items:
        if "answer_ids" in item:
            parts.append(torch.as_tensor(item["answer_ids"], dtype=torch.long))
        else:
            parts.append(item["ids"][item["answer_start"]:].long())
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def token_counts(tokens: torch.LongTensor, vocab_size: int) -> torch.LongTensor:
    """How often each of the ``vocab_size`` ids occurs in ``tokens``."""
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"Token ids outside [0, {vocab_size}) in the corpus; it was tokenised for another model.")
    return torch.bincount(tokens, minlength=vocab_size)


def special_token_ids(target: PreTrainedModel, mask_token_id: int | None) -> list[int]:
    """EOS, pad and BOS ids of the target's config and the draft's mask token (those that are set)."""
    config = target.config.get_text_config()
    ids = []
    for value in (config.eos_token_id, config.pad_token_id, config.bos_token_id, mask_token_id):
        ids.extend(value if isinstance(value, (list, tuple)) else [value])
    return sorted({int(i) for i in ids if i is not None and 0 <= int(i) < config.vocab_size})


def select_draft_vocab(counts: torch.LongTensor, size: int, required_ids: Sequence[int] = ()) -> torch.LongTensor:
    """The ``required_ids`` plus the most frequent other ids up to ``size`` in all, sorted (int64).

    Ties are broken by the lower id (a stable sort), so the choice is deterministic.
    """
    vocab_size = counts.numel()
    required = sorted(set(int(i) for i in required_ids))
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size {size} must lie in [1, {vocab_size}] (the target's vocabulary).")
    if len(required) > size:
        raise ValueError(f"draft_vocab_size {size} is smaller than the {len(required)} special ids it must hold "
                         f"({required}); choose a larger size.")
    chosen = torch.zeros(vocab_size, dtype=torch.bool)
    chosen[required] = True
    order = torch.sort(counts, descending=True, stable=True).indices
    rest = order[~chosen[order]][: size - len(required)]
    chosen[rest] = True
    return torch.nonzero(chosen).flatten()


LARGE_VOCAB = 32768  # above this, a fresh draft gets a reduced vocabulary by default
AUTO_SIZES = (8192, 16384, 32768)
AUTO_COVERAGE = 0.98


def auto_draft_vocab_size(records: Sequence[dict], vocab_size: int,
                          required_ids: Sequence[int] = ()) -> tuple[int | None, str]:
    """(N, why): the draft vocabulary size a run uses when none was asked for.

    None (the full vocabulary) up to :data:`LARGE_VOCAB` ids. Above it, the smallest of
    :data:`AUTO_SIZES` whose ids, chosen on the even-numbered answers, hold :data:`AUTO_COVERAGE` of
    the odd-numbered answers' tokens (a held-out estimate: coverage of the answers the ids were chosen
    on overstates it), else the largest. The draft borrows the target's LM head at every block
    position, so its rows are most of a large-vocabulary draft's cost.
    """
    if vocab_size <= LARGE_VOCAB:
        return None, f"the target's {vocab_size:,} ids are few enough to draft over all of them"
    fit, check = answer_tokens(records[0::2]), answer_tokens(records[1::2])
    counts = token_counts(fit, vocab_size)
    for size in AUTO_SIZES:
        held = coverage(select_draft_vocab(counts, size, required_ids), check)
        if held >= AUTO_COVERAGE or size == AUTO_SIZES[-1]:
            break
    return size, (f"the target has {vocab_size:,} ids; {size:,} chosen on half the answers hold {held:.1%} of the "
                  f"other half's tokens (the smallest of {', '.join(map(str, AUTO_SIZES))} reaching "
                  f"{AUTO_COVERAGE:.0%}, else the largest)")


def coverage(ids: torch.LongTensor, tokens: torch.LongTensor) -> float:
    """Share of ``tokens`` inside ``ids``."""
    if tokens.numel() == 0:
        return float("nan")
    return float(torch.isin(tokens, ids).float().mean())


def coverage_table(train_items: Iterable[dict], held_out_items: Iterable[dict], vocab_size: int,
                   sizes: Sequence[int] = COVERAGE_SIZES, required_ids: Sequence[int] = ()) -> list[dict]:
    """For each N in ``sizes``: the held-out answer tokens inside the subset chosen on the training
    answers (``{"size", "held_out_coverage", "train_coverage"}``)."""
    train_tokens, held_out = answer_tokens(train_items), answer_tokens(held_out_items)
    counts = token_counts(train_tokens, vocab_size)
    rows = []
    for size in sizes:
        ids = select_draft_vocab(counts, min(size, vocab_size), required_ids)
        rows.append({"size": int(ids.numel()), "held_out_coverage": coverage(ids, held_out),
                     "train_coverage": coverage(ids, train_tokens)})
    return rows


# ------------------------------------------------------------------------------- target normaliser
@torch.no_grad()
def add_target_lse(items: list[dict], target_head: nn.Module, rows_per_batch: int = 512,
                   show_progress: bool = True) -> int:
    """Adds ``item["target_lse"]`` (float32 (L,), on CPU) to every item lacking it:
    ``logsumexp(target_head(final))`` computed exactly as training computes the target's logits
    (float32 final hidden states). Returns how many items were completed."""
    weight = target_head.weight
    missing = [item for item in items if "target_lse" not in item]
    for item in tqdm(missing, desc="Target log-normalisers", unit="seq", disable=not (missing and show_progress)):
        final = item["final"]
        parts = [torch.logsumexp(target_head(final[start:start + rows_per_batch].to(weight.device, torch.float32))
                                 .float(), dim=-1).cpu() for start in range(0, final.shape[0], rows_per_batch)]
        item["target_lse"] = torch.cat(parts) if parts else torch.empty(0)
    return len(missing)


def ensure_target_lse(items: list[dict], target_head: nn.Module, path: Path, layer_ids: list[int]) -> None:
    """Completes a feature cache with ``target_lse`` and re-saves it when anything was added
    (written next to it, then moved over it, so a reader of the old file keeps a whole one)."""
    if add_target_lse(items, target_head) == 0:
        return
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    torch.save({"layer_ids": list(layer_ids), "items": items}, partial)
    os.replace(partial, path)
    logger.warning(f"Feature cache {path}: added the target's log-normaliser (target_lse) for a reduced vocabulary.")


# ------------------------------------------------------------------------------------------ loss
def target_subset_logits(draft: DSparkDraftModel, target_head: nn.Module, final: torch.Tensor) -> torch.Tensor:
    """The target's logits of the draft vocabulary only, (..., N), from its final hidden states.

    The gathered rows have a cache of their own even where the draft borrows this head: the draft's copy may
    be cast for training in bfloat16 (:func:`~dspark_hf.model.draft_vocab.subset_logits`) while the target's
    logits stay in the head's dtype, and one shared single-entry cache would gather again at every call. The rows
    are a plain matmul even where an engine prepared the head (``prepared=False``: faster for training's many
    rows)."""
    return subset_logits(target_head, final, draft.draft_vocab_ids, _TARGET_HEAD_CACHE, prepared=False)


def reduced_vocab_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    target_lse: torch.Tensor,
    labels: torch.LongTensor,
    draft_vocab_ids: torch.LongTensor,
    confidence_logits: torch.Tensor | None,
    *,
    weights: torch.Tensor,
    ce_weight: float,
    tv_weight: float,
    conf_weight: float,
    ce_target: str = "label",
) -> dict[str, torch.Tensor]:
    """The paper's loss (:func:`dspark_hf.training.trainer.dspark_loss`) for a reduced draft vocabulary.

    Args:
        draft_logits: ``U + B`` over the subset, (A, gamma, N) in ``draft_vocab_ids`` order.
        target_logits: the target's logits of the same N ids, (A, gamma, N).
        target_lse: the target's log-normaliser over the whole vocabulary, (A, gamma).
        labels: the true tokens (target ids), (A, gamma).
        confidence_logits: pre-sigmoid ``c_k``, (A, gamma), or None.
        weights: per-position weights (gamma,).
        ce_target: ``"label"`` or ``"distribution"`` (cross-entropy to the target's distribution over the
            subset; the mass outside it, which the draft cannot propose, is left to the TV term).

    Returns the keys of ``dspark_loss`` (``ce`` averaged over the labels inside the subset) plus
    ``label_outside_share``, the share of positions whose label is outside it (CE skipped there).
    """
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    q = log_q.exp()
    p_subset = torch.exp(target_logits.float() - target_lse.float()[..., None])
    outside_mass = (1.0 - p_subset.sum(-1)).clamp_min(0.0)
    tv = (q - p_subset).abs().sum(-1) + outside_mass
    ids = draft_vocab_ids.to(labels.device)
    slots = torch.searchsorted(ids, labels).clamp_(max=ids.numel() - 1)
    inside = ids[slots] == labels
    check_ce_target(ce_target)
    if ce_target == "distribution":
        ce = -(p_subset * log_q).sum(-1)
        counted = torch.ones_like(inside)
    else:
        ce = -log_q.gather(-1, slots.to(log_q.device)[..., None]).squeeze(-1) * inside.to(log_q.device)
        counted = inside
    loss, bce, acceptance = combine_loss_terms(ce, tv, confidence_logits, weights, ce_weight=ce_weight,
                                               tv_weight=tv_weight, conf_weight=conf_weight)
    drafted = ids[draft_logits.argmax(-1).to(ids.device)]
    return {
        "loss": loss,
        "ce": (ce.sum() / counted.sum().clamp_min(1)).detach(),
        "tv": tv.mean().detach(),
        "bce": bce.mean().detach(),
        "accuracy": (drafted == labels).float().mean(0).detach(),
        "acceptance": acceptance.mean(0).detach(),
        "label_outside_share": (~inside).float().mean().detach(),
    }


__all__ = ["AUTO_COVERAGE", "AUTO_SIZES", "COVERAGE_SIZES", "LARGE_VOCAB", "add_target_lse", "answer_tokens", "auto_draft_vocab_size", "coverage", "coverage_table", "ensure_target_lse",
           "reduced_vocab_loss", "select_draft_vocab", "special_token_ids", "target_subset_logits", "token_counts"]
