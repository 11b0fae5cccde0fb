"""Training DSpark / DFlash drafts for any transformers causal LM (paper section 3.3).

Recipe: the target is frozen; the draft shares (and freezes) the target's embedding and LM head.
Each training sequence (a prompt answered by the target itself, see :mod:`dspark_hf.training.data`)
contributes random anchors; an anchor ``a`` forms the block ``[x_a, MASK * (gamma-1)]`` at
positions ``a..a+gamma-1`` whose outputs predict ``x_{a+1}..x_{a+gamma}``. A block attends to the
target features of the context strictly before its anchor and to its own tokens; many blocks of
one sequence are packed into one forward with that mask.

Loss per position k, weighted by ``w_k = exp(-(k-1)/gamma)`` and summed over k:
``0.1 * CE(p_d, x*) + 0.9 * ||p_d - p_t||_1 + 1.0 * BCE(c_k, 1 - 0.5 * ||p_d - p_t||_1)``, with
``p_d = softmax(U_k + B_k(x*_{k-1}))`` (teacher forcing: the Markov head sees the true previous
token) and ``p_t`` the target's next-token distribution at that position.

Target features (the hidden states of ``target_layer_ids`` and the final hidden state that gives
``p_t``) come from :mod:`dspark_hf.training.features`: cached on disk in half precision, or
recomputed per step (online); both give the same numbers.

Runs under accelerate: one process, or several (``accelerate launch`` / ``torchrun``) that split each
step's global batch and sum their gradients (:mod:`dspark_hf.training.distributed`), with a progress
bar, periodic checkpoints written atomically by the main process, ``resume``, a time budget, and a
JSONL log of the loss terms and per-position accuracy. The whole pipeline (answers, features,
training, calibration, card, export) is :mod:`dspark_hf.training.pipeline`; its command line is
``dspark-hf train`` (:mod:`dspark_hf.training.train_cli`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.utils import logging

from ..model.configuration_dspark import DSparkConfig
from ..model.heads import confidence_logits
from ..model.modeling_dspark import DSparkDraftModel
from .distributed import Ranks, atomic_torch_save, atomic_write_json
from .draft_start import init_from_saved_draft, init_from_target_layers
from .draft_vocab_training import (add_target_lse, coverage, reduced_vocab_loss, select_draft_vocab,
                                   special_token_ids, target_subset_logits, token_counts)
from .features import FeatureSource, ListFeatures, as_feature_source, build_feature_cache, target_features
from .loss_terms import check_ce_target, combine_loss_terms
from .precision import precision_context, resolve_precision
from .run_clock import budget_time
from .target_loading import finish_logits, plain_head, target_head

# Re-exported: the feature functions lived here before features.py (benchmarks and tests import them).
__all__ = ["NonFiniteTrainingError", "TrainingConfig", "block_attention_mask", "build_feature_cache", "choose_draft_vocab", "draft_block_outputs",
           "dspark_loss", "init_from_saved_draft", "init_from_target_layers", "make_draft", "position_weights",
           "sample_anchors", "serial_logits_teacher_forced", "step_loss", "target_features", "train"]

logger = logging.get_logger(__name__)

FIT_AFTER_STEPS = 6  # steps timed (from the second) before a budgeted run sizes its schedule
REFIT_TOLERANCE = 0.1  # a later re-check resizes the schedule only when it moves this much


def _draft_default(field_name: str):
    """The default of a :class:`DSparkConfig` field: a draft's architecture has one source of defaults."""
    return next(f.default for f in dataclasses.fields(DSparkConfig) if f.name == field_name)


@dataclass
class TrainingConfig:
    """Everything that defines a training run (saved as ``training_config.json``).

    The draft's architecture fields default to :class:`~dspark_hf.DSparkConfig`'s defaults
    (``markov_rank`` 256, for one); the shipped drafts' training commands give theirs explicitly.
    """

    block_size: int = _draft_default("block_size")
    num_hidden_layers: int = _draft_default("num_hidden_layers")
    markov_rank: int = _draft_default("markov_rank")
    markov_head_type: str = _draft_default("markov_head_type")
    confidence_head: bool = _draft_default("enable_confidence_head")
    confidence_head_with_markov: bool = _draft_default("confidence_head_with_markov")
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    anchors_per_sequence: int = 16
    sequences_per_step: int = 4
    max_seq_len: int = 512
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    max_steps: int = 1000
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    # what the cross-entropy term aims at: "label", the sequence's next token (the paper's), or "distribution",
    # the target's whole next-token distribution (a teacher-forced text's tokens are not the target's own)
    ce_target: str = "label"
    # the draft's matmuls: "float32", "bfloat16" (autocast; the loss terms stay float32), or "auto": bfloat16
    # where this machine runs the draft's widest matmul clearly faster in it (training.precision)
    precision: str = "auto"
    init_from_target: bool = True
    init_from_draft: str | None = None  # warm start: a saved draft folder with the same architecture
    draft_vocab_size: int | None = None  # reduced draft vocabulary of N ids (dspark_hf.model.draft_vocab); 0/None = all
    held_out_sequences: int = 32
    save_every: int = 200
    snapshot_every: int = 0  # also save the draft itself to snapshots/step-N every N steps (0 = never)
    log_every: int = 10
    seed: int = 0
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------- blocks & mask
def sample_anchors(
    seq_len: int, answer_start: int, num_anchors: int, block_size: int, generator: torch.Generator
) -> torch.LongTensor:
    """Distinct sorted anchor positions ``a`` with ``answer_start - 1 <= a <= seq_len - 1 - block_size``.

    The block of anchor ``a`` predicts tokens ``a+1..a+block_size``, all inside the sequence and
    in the answer (the first block after the prompt predicts the first answer token).
    """
    low, high = max(answer_start - 1, 0), seq_len - 1 - block_size
    if high < low:
        return torch.empty(0, dtype=torch.long)
    count = min(num_anchors, high - low + 1)
    return (torch.randperm(high - low + 1, generator=generator)[:count] + low).sort().values


def block_attention_mask(anchors: torch.LongTensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask (A*gamma, context_len + A*gamma): block i sees context ``< anchors[i]`` and itself."""
    num_blocks = anchors.numel()
    context = torch.arange(context_len)[None, :] < anchors[:, None]  # (A, L)
    context = context.repeat_interleave(block_size, dim=0)  # (A*gamma, L)
    block_ids = torch.arange(num_blocks).repeat_interleave(block_size)
    own_block = block_ids[:, None] == block_ids[None, :]  # (A*gamma, A*gamma)
    return torch.cat([context, own_block], dim=1)


def position_weights(block_size: int, device=None) -> torch.Tensor:
    """``w_k = exp(-(k-1)/gamma)`` for k = 1..gamma."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / block_size)


# --------------------------------------------------------------------------------------- loss
def dspark_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.LongTensor,
    confidence_logits: torch.Tensor | None,
    *,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    conf_weight: float = 1.0,
    ce_target: str = "label",
) -> dict[str, torch.Tensor]:
    """The paper's loss for blocks of draft predictions.

    Args:
        draft_logits: ``U + B`` per block position, (A, gamma, V).
        target_logits: the target's logits for the same positions, (A, gamma, V).
        labels: the true tokens, (A, gamma).
        confidence_logits: pre-sigmoid ``c_k``, (A, gamma), or None without a confidence head.
        ce_target: ``"label"`` (cross-entropy to ``labels``) or ``"distribution"`` (to the target's
            distribution: ``-sum_v p_t(v) log p_d(v)``).

    Returns a dict with ``loss`` (mean over blocks of the position-weighted sum), the unweighted
    means ``ce``, ``tv`` (L1 distance), ``bce``, and per-position ``accuracy`` (argmax == label)
    and ``acceptance`` (``1 - tv/2``, the expected acceptance at temperature 1).
    """
    gamma = draft_logits.shape[1]
    weights = position_weights(gamma, draft_logits.device)
    log_p_draft = torch.log_softmax(draft_logits.float(), dim=-1)
    p_draft = log_p_draft.exp()
    p_target = torch.softmax(target_logits.float(), dim=-1)
    check_ce_target(ce_target)
    if ce_target == "distribution":
        ce = -(p_target * log_p_draft).sum(-1)
    else:
        ce = F.nll_loss(log_p_draft.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels).float()
    tv = (p_draft - p_target).abs().sum(-1)
    loss, bce, acceptance = combine_loss_terms(ce, tv, confidence_logits, weights, ce_weight=ce_weight,
                                               tv_weight=tv_weight, conf_weight=conf_weight)
    return {
        "loss": loss,
        "ce": ce.mean().detach(),
        "tv": tv.mean().detach(),
        "bce": bce.mean().detach(),
        "accuracy": (draft_logits.argmax(-1) == labels).float().mean(0).detach(),
        "acceptance": acceptance.mean(0).detach(),
    }


# ------------------------------------------------------------------------------ forward pieces
def draft_block_outputs(draft: DSparkDraftModel, item: dict, anchors: torch.LongTensor):
    """Packed forward over all blocks of one sequence.

    Returns (base logits U (A, gamma, V), hidden h (A, gamma, d), previous tokens (A, gamma),
    labels (A, gamma)).
    """
    gamma = draft.config.block_size
    device = draft.fc.weight.device
    ids = item["ids"].to(device)
    context_len = int(anchors.max()) if anchors.numel() else 0  # blocks never see past their anchor
    offsets = torch.arange(gamma, device=device)
    block_positions = (anchors.to(device)[:, None] + offsets).flatten()
    block_ids = torch.full((anchors.numel(), gamma), draft.config.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = ids[anchors]
    cache = draft.new_cache()
    if context_len > 0:
        draft.add_context(cache, item["context"][:context_len].to(device, torch.float32)[None],
                          torch.arange(context_len, device=device)[None])
    mask = block_attention_mask(anchors.cpu(), context_len, gamma).to(device)
    full_vocab = draft.draft_vocab_ids is None  # a reduced draft vocabulary trains on its N-wide logits
    out = draft(block_ids.flatten()[None], block_positions[None], cache, attention_mask=mask[None, None],
                compute_logits=full_vocab)
    hidden = out.hidden_states[0].view(anchors.numel(), gamma, -1)
    logits = (out.logits[0] if full_vocab else draft.draft_vocab_logits(hidden)).view(anchors.numel(), gamma, -1)
    label_positions = anchors.to(device)[:, None] + offsets + 1
    labels = ids[label_positions]
    previous = ids[label_positions - 1]
    return logits, hidden, previous, labels


def serial_logits_teacher_forced(draft: DSparkDraftModel, base_logits, hidden, previous):
    """``U_k + B_k`` with the Markov head fed the true previous tokens; plus confidence logits."""
    logits, features = base_logits, None
    if draft.markov_head is not None:
        head = draft.markov_head
        # One lookup of W1 for every position, shared with the confidence head: each lookup's backward
        # writes a dense vocabulary x rank gradient, which cost more than the rest of the head.
        features = head.markov_w1(previous)
        state = head.initial_state(previous.shape[0], hidden.device, hidden.dtype)
        if state is None:  # position-wise heads (no recurrent state): every position at once
            bias, _ = head.bias_from_feature(features.flatten(0, 1), hidden.flatten(0, 1), None)
            logits = logits + bias.view(*previous.shape, -1)
        else:
            biases = []
            for k in range(previous.shape[1]):
                bias, state = head.bias_from_feature(features[:, k], hidden[:, k], state)
                biases.append(bias)
            logits = logits + torch.stack(biases, dim=1)
    confidence = None
    if draft.confidence_head is not None:
        confidence = confidence_logits(draft, hidden, previous, features)
    return logits, confidence


def step_loss(draft, target_head, item, anchors, cfg: TrainingConfig) -> dict[str, torch.Tensor]:
    """The loss terms of one sequence's blocks at ``anchors``; ``target_head`` maps the target's final
    hidden states to its logits (:func:`~dspark_hf.training.target_loading.target_head`)."""
    base, hidden, previous, labels = draft_block_outputs(draft, item, anchors)
    draft_logits, confidence = serial_logits_teacher_forced(draft, base, hidden, previous)
    final = item["final"].to(hidden.device, torch.float32)
    label_positions = anchors.to(hidden.device)[:, None] + torch.arange(cfg.block_size, device=hidden.device) + 1
    # The target's logits are the training signal: always in its head's dtype, outside a bfloat16 autocast.
    exact = torch.autocast(hidden.device.type, enabled=False)
    if draft.draft_vocab_ids is not None:  # exact loss from the subset and the cached normaliser
        with torch.no_grad(), exact:  # rows of the plain head, then the family's logit rule (elementwise)
            target_logits = finish_logits(target_head, target_subset_logits(draft, plain_head(target_head),
                                                                             final[label_positions - 1]))
        lse = item["target_lse"].to(hidden.device)[label_positions - 1]
        return reduced_vocab_loss(draft_logits, target_logits, lse, labels, draft.draft_vocab_ids, confidence,
                                  weights=position_weights(cfg.block_size, hidden.device), ce_weight=cfg.ce_weight,
                                  tv_weight=cfg.tv_weight, conf_weight=cfg.conf_weight, ce_target=cfg.ce_target)
    with torch.no_grad(), exact:
        target_logits = target_head(final[label_positions - 1].to(plain_head(target_head).weight.dtype))
    return dspark_loss(draft_logits, target_logits, labels, confidence, ce_weight=cfg.ce_weight,
                       tv_weight=cfg.tv_weight, conf_weight=cfg.conf_weight, ce_target=cfg.ce_target)


# ------------------------------------------------------------------------------------ training
def make_draft(target: PreTrainedModel, cfg: TrainingConfig, draft_vocab_ids=None) -> DSparkDraftModel:
    """A fresh draft for ``cfg``; ``draft_vocab_ids`` (N ids, see :func:`choose_draft_vocab`) when
    ``cfg.draft_vocab_size`` asks for a reduced draft vocabulary."""
    if bool(cfg.draft_vocab_size) != (draft_vocab_ids is not None):
        raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} needs draft_vocab_ids (choose_draft_vocab), and "
                         "draft_vocab_ids need a draft_vocab_size; pass both or neither.")
    draft = DSparkDraftModel.from_target(
        target, block_size=cfg.block_size, num_hidden_layers=cfg.num_hidden_layers,
        target_layer_ids=cfg.target_layer_ids, markov_rank=cfg.markov_rank,
        markov_head_type=cfg.markov_head_type, confidence_head=cfg.confidence_head,
        confidence_head_with_markov=cfg.confidence_head_with_markov, mask_token_id=cfg.mask_token_id,
        draft_vocab_ids=draft_vocab_ids,
    )
    draft = draft.float()
    draft.config.num_anchors = cfg.anchors_per_sequence  # DeepSpec's field records what training used
    if cfg.init_from_target:  # a warm start then overwrites all but the layers it adds
        init_from_target_layers(draft, target)
    if cfg.init_from_draft:
        init_from_saved_draft(draft, cfg.init_from_draft)
    return draft


# ------------------------------------------------------------------------------------ training
def _learning_rate_schedule(cfg: TrainingConfig):
    def factor(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def _metric_vector(out: dict[str, torch.Tensor], reduced: bool) -> torch.Tensor:
    """One sequence's logged terms as a vector: loss, ce, tv, bce, [label_outside_share], accuracy per position."""
    scalars = [out["loss"].detach(), out["ce"], out["tv"], out["bce"]] + ([out["label_outside_share"]] if reduced else [])
    return torch.cat([torch.stack([v.float() for v in scalars]), out["accuracy"].float()])


def _metrics(vector: torch.Tensor, reduced: bool) -> dict[str, torch.Tensor]:
    names = ["loss", "ce", "tv", "bce"] + (["label_outside_share"] if reduced else [])
    return {name: vector[i] for i, name in enumerate(names)} | {"accuracy": vector[len(names):]}


class NonFiniteTrainingError(ValueError):
    """A training step produced an inf or NaN loss or gradient; nothing of that step was applied."""


def _stop_if_not_finite(step: int, sums: torch.Tensor, grad_norm, reduced: bool, checkpoint: Path, done: int,
                        save_last_good) -> None:
    """Raises :class:`NonFiniteTrainingError` naming the terms when step ``step``'s loss or gradient
    is not finite, after ``save_last_good()`` keeps the state before the step (one sync per step)."""
    values = torch.cat([sums.detach().float().reshape(-1), torch.as_tensor(grad_norm).float().reshape(1).to(sums.device)])
    if bool(torch.isfinite(values).all()):
        return
    names = ["loss", "ce", "tv", "bce"] + (["label_outside_share"] if reduced else [])
    bad = [name for name, value in zip(names, values[: len(names)].tolist()) if not math.isfinite(value)]
    if not math.isfinite(float(values[-1])):
        bad.append("gradient norm")
    save_last_good()
    kept = (f"The last good state (step {done}) is in {checkpoint}; `--resume` continues from it once the cause is "
            "fixed." if (checkpoint / "state.pt").exists() else "No step had completed, so there is no checkpoint.")
    raise NonFiniteTrainingError(
        f"Training step {step}: {', '.join(bad)} not finite; stopped before applying it. The usual causes: target "
        "features beyond their dtype's range (recompute them with --feature-dtype bfloat16 in a fresh --feature-dir), "
        f"or a learning rate too high for this draft (--learning-rate). {kept}")


def _save_checkpoint(folder: Path, step: int, draft, optimizer, scheduler, generator, accelerator) -> None:
    """The whole training state (draft, optimiser, schedule, the batch generator), replaced atomically."""
    state = {"step": step, "draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "generator": generator.get_state()}
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler.state_dict()
    atomic_torch_save(state, folder / "state.pt")
    atomic_write_json(folder / "step.json", {"step": step})  # for people and scripts; state.pt is the record


def _load_checkpoint(folder: Path, draft, optimizer, scheduler, generator, accelerator) -> int:
    """Restores :func:`_save_checkpoint`'s state; returns its step (0 when there is no checkpoint)."""
    path = folder / "state.pt"
    if not path.exists():
        if (folder / "step.json").exists():
            raise ValueError(f"{folder} holds a checkpoint of an older dspark_hf (accelerate's save_state); resume it "
                             "with that version, or start again without --resume.")
        logger.warning(f"--resume: no checkpoint in {folder}; starting from step 0.")
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    draft.load_state_dict(state["draft"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    generator.set_state(state["generator"])
    if "scaler" in state and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    logger.warning(f"Resuming from step {state['step']}.")
    return int(state["step"])


def train(target: PreTrainedModel, items: list[dict] | FeatureSource, cfg: TrainingConfig, output_dir: str | Path,
          resume: bool = False, *, deadline: float | None = None, accelerator=None,
          show_progress: bool = True, fit_steps_to_deadline: bool = False) -> DSparkDraftModel:
    """Trains a fresh draft on ``items`` and saves it to ``output_dir``; returns it.

    ``items`` are feature-cache items (:func:`build_feature_cache`) or a
    :class:`~dspark_hf.training.features.FeatureSource` (chunked cache or online features). Each step
    draws ``cfg.sequences_per_step`` sequences and their anchors from one generator seeded with
    ``cfg.seed``; with several processes every process draws the same and computes its share
    (positions ``rank, rank + W, ...``), and the gradients are summed before the step, so the
    result equals a one-process run within floating-point rounding.

    ``output_dir/checkpoint`` holds the whole state every ``save_every`` steps (written by the main
    process, atomically); ``resume`` continues from it as if never stopped. ``deadline`` (a
    ``budget_time()`` value) stops after the first step that ends past it, with a checkpoint, so
    a later ``resume`` goes on. With ``fit_steps_to_deadline`` the run times its steps
    :data:`FIT_AFTER_STEPS` steps in and sets ``cfg.max_steps`` to what fits before the deadline, so
    the learning-rate schedule ends with the budget instead of being cut mid-way; it checks again
    every quarter of the run and resizes when the fit moves by more than :data:`REFIT_TOLERANCE`. A step whose loss or
    gradient is not finite stops the run (:class:`NonFiniteTrainingError`), keeping the last good
    state as the checkpoint. ``output_dir/train_log.jsonl`` gets one line per ``log_every`` steps
    and ``training_progress.json`` the steps done. With ``snapshot_every``,
    ``output_dir/snapshots/step-N`` holds the draft after N steps, loadable with ``from_pretrained``.
    """
    from accelerate import Accelerator

    source = as_feature_source(items)
    output_dir = Path(output_dir)
    accelerator = accelerator or Accelerator(cpu=target.device.type == "cpu")
    ranks = Ranks.current()
    if ranks.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(output_dir / "training_config.json", asdict(cfg))
    torch.manual_seed(cfg.seed)
    target.requires_grad_(False)
    head = target_head(target)
    draft = make_draft(target, cfg, choose_draft_vocab(target, source, cfg) if cfg.draft_vocab_size else None)
    draft.to(accelerator.device)
    ranks.broadcast_parameters_(draft)
    precision, why = ranks.broadcast(resolve_precision(
        cfg.precision, accelerator.device, rows=cfg.anchors_per_sequence * cfg.block_size,
        hidden=draft.config.hidden_size, vocab=cfg.draft_vocab_size or draft.config.vocab_size))
    if ranks.is_main:
        logger.warning(f"Training precision: {precision} ({why}; --precision sets it).")
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _learning_rate_schedule(cfg))
    # Only the optimiser goes through accelerate (fp16 loss scaling on GPUs): a prepared scheduler
    # would step once per process, and a prepared model is a DDP wrapper whose forward this loop
    # never calls (gradients are summed by Ranks.sum_gradients_).
    optimizer = accelerator.prepare_optimizer(optimizer)
    draft.bind_target(target)

    checkpoint = output_dir / "checkpoint"
    generator = torch.Generator().manual_seed(cfg.seed)
    start_step = _load_checkpoint(checkpoint, draft, optimizer, scheduler, generator, accelerator) if resume else 0
    if not resume and (checkpoint / "step.json").exists() and ranks.is_main:
        logger.warning(f"{checkpoint} exists; starting again from step 0 (pass --resume to continue from it).")
    reduced = draft.draft_vocab_ids is not None
    log = (output_dir / "train_log.jsonl").open("a" if resume else "w") if ranks.is_main else None
    draft.train()
    bar = tqdm(total=cfg.max_steps, initial=start_step, desc="Training draft",
               disable=not (show_progress and ranks.is_main))
    window: list[dict[str, torch.Tensor]] = []  # per-step metrics since the last log line
    done, stopped, step = start_step, False, start_step - 1
    timed_from, timed_steps, refit_every = None, start_step, 0
    while step + 1 < cfg.max_steps:
        step += 1
        if fit_steps_to_deadline and deadline is not None:
            if done == start_step + 1:  # the first step pays one-off costs: time from the second on
                timed_from, timed_steps = budget_time(), done
            elif timed_from is not None and done - timed_steps >= max(FIT_AFTER_STEPS - 1, refit_every):
                per_step = (budget_time() - timed_from) / (done - timed_steps)
                fitted = done + max(1, int(ranks.broadcast((deadline - budget_time()) / per_step)))
                first = refit_every == 0
                if first or abs(fitted - cfg.max_steps) > REFIT_TOLERANCE * cfg.max_steps:
                    if ranks.is_main:
                        logger.warning(f"Training: {per_step:.2f} s per step; {fitted} steps fit the time budget "
                                       f"(the learning-rate schedule is sized to them; was {cfg.max_steps}).")
                    cfg.max_steps, bar.total = fitted, fitted
                    bar.refresh()
                # the machine's speed can change (another job starts or ends): check again every quarter
                timed_from, timed_steps, refit_every = budget_time(), done, max(FIT_AFTER_STEPS, fitted // 4)
        picks = torch.randint(len(source), (cfg.sequences_per_step,), generator=generator).tolist()
        batch = [(index, sample_anchors(*source.shape(index), cfg.anchors_per_sequence, cfg.block_size, generator))
                 for index in picks]
        counted = sum(anchors.numel() > 0 for _, anchors in batch)
        if counted == 0:
            bar.update(1)
            continue
        sums = None
        for position in ranks.share(len(batch)):
            index, anchors = batch[position]
            if anchors.numel() == 0:
                continue
            with accelerator.autocast(), precision_context(precision, accelerator.device):
                out = step_loss(draft, head, source.item(index), anchors, cfg)
            # one backward per sequence: only one sequence's graph is alive at a time
            accelerator.backward(out["loss"] / counted)
            vector = _metric_vector(out, reduced)
            sums = vector if sums is None else sums + vector
        ranks.sum_gradients_(params)
        grad_norm = accelerator.clip_grad_norm_(params, 1.0)
        step_sums = ranks.all_reduce_(sums if sums is not None else
                                      torch.zeros(4 + reduced + cfg.block_size, device=accelerator.device))
        if accelerator.scaler is None:  # fp16 loss scaling skips overflowing steps itself
            _stop_if_not_finite(step + 1, step_sums, grad_norm, reduced, checkpoint, done,
                                lambda: _save_checkpoint(checkpoint, done, draft, optimizer, scheduler, generator,
                                                         accelerator) if ranks.is_main and done > start_step else None)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.append(_metrics(step_sums / counted, reduced))
        done = step + 1
        bar.update(1)
        stopped = deadline is not None and done < cfg.max_steps and ranks.any(budget_time() >= deadline,
                                                                                  accelerator.device)
        if (done % cfg.log_every == 0 or done == cfg.max_steps or stopped) and log is not None:
            means = {key: torch.stack([w[key] for w in window]).mean(0) for key in window[0]}
            acc = means.pop("accuracy").tolist()
            record = {"step": done, "lr": scheduler.get_last_lr()[0], "time": time.time(),
                      **{k: float(v) for k, v in means.items()}, "accuracy_per_position": acc}
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{acc[0]:.2f}")
        if done % cfg.log_every == 0 or stopped:
            window = []
        if cfg.snapshot_every and done % cfg.snapshot_every == 0 and done < cfg.max_steps and ranks.is_main:
            draft.eval()
            draft.save_pretrained(output_dir / "snapshots" / f"step-{done}")
            draft.train()
        if ((done % cfg.save_every == 0 and done < cfg.max_steps) or stopped) and ranks.is_main:
            _save_checkpoint(checkpoint, done, draft, optimizer, scheduler, generator, accelerator)
        if stopped:
            logger.warning(f"Training stopped at step {done} of {cfg.max_steps}: the time budget is spent. The "
                           "checkpoint is saved; run again with --resume to go on.")
            break
    bar.close()
    if log is not None:
        log.close()
    draft.eval()
    if ranks.is_main:
        draft.save_pretrained(output_dir)
        atomic_write_json(output_dir / "training_config.json", asdict(cfg))  # max_steps as fitted to the budget
        atomic_write_json(output_dir / "training_progress.json",
                          {"steps_done": done, "max_steps": cfg.max_steps, "stopped_by_time_budget": stopped,
                           "processes": ranks.world_size, "precision": precision})
    ranks.barrier()
    return draft


def choose_draft_vocab(target: PreTrainedModel, items: list[dict] | FeatureSource,
                       cfg: TrainingConfig) -> torch.LongTensor:
    """The ``cfg.draft_vocab_size`` most frequent answer tokens of ``items`` plus the special ids
    (:func:`dspark_hf.training.draft_vocab_training.select_draft_vocab`); gives items held in memory
    their ``target_lse`` when missing (online and chunked sources bring their own) and logs the
    training-answer coverage."""
    source = as_feature_source(items)
    parts = [source.token_ids(i)[source.shape(i)[1]:] for i in range(len(source))]
    tokens = torch.cat(parts).long() if parts else torch.empty(0, dtype=torch.long)
    ids = select_draft_vocab(token_counts(tokens, target.config.get_text_config().vocab_size), cfg.draft_vocab_size,
                             special_token_ids(target, cfg.mask_token_id))
    if isinstance(source, ListFeatures):
        add_target_lse(source.items(), target_head(target))
    logger.warning(f"Draft vocabulary: {ids.numel()} ids hold {coverage(ids, tokens):.2%} of the training answer "
                   "tokens; cross-entropy skips labels outside it (label_outside_share in the log).")
    return ids
