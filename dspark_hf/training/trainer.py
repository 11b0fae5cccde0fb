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
``p_t``) are computed once per corpus and cached on disk in fp16.

Runs under accelerate (one CPU here, several GPUs elsewhere), with a progress bar, periodic
checkpoints, ``--resume`` and a JSONL log of the loss terms and per-position accuracy.
The command line is :mod:`dspark_hf.training.train_cli` (``python -m dspark_hf.training --help``).
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

from ..configuration_dspark import DSparkConfig, hidden_state_indices
from ..heads import confidence_logits
from ..modeling_dspark import DSparkDraftModel
from .draft_vocab_training import (add_target_lse, answer_tokens, coverage, ensure_target_lse, reduced_vocab_loss,
                                   select_draft_vocab, special_token_ids, target_subset_logits, token_counts)
from .loss_terms import combine_loss_terms

logger = logging.get_logger(__name__)


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
    init_from_target: bool = True
    init_from_draft: str | None = None  # warm start: a saved draft folder with the same architecture
    draft_vocab_size: int | None = None  # reduced draft vocabulary of N ids (dspark_hf.draft_vocab); 0/None = all
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
) -> dict[str, torch.Tensor]:
    """The paper's loss for blocks of draft predictions.

    Args:
        draft_logits: ``U + B`` per block position, (A, gamma, V).
        target_logits: the target's logits for the same positions, (A, gamma, V).
        labels: the true tokens, (A, gamma).
        confidence_logits: pre-sigmoid ``c_k``, (A, gamma), or None without a confidence head.

    Returns a dict with ``loss`` (mean over blocks of the position-weighted sum), the unweighted
    means ``ce``, ``tv`` (L1 distance), ``bce``, and per-position ``accuracy`` (argmax == label)
    and ``acceptance`` (``1 - tv/2``, the expected acceptance at temperature 1).
    """
    gamma = draft_logits.shape[1]
    weights = position_weights(gamma, draft_logits.device)
    log_p_draft = torch.log_softmax(draft_logits.float(), dim=-1)
    p_draft = log_p_draft.exp()
    p_target = torch.softmax(target_logits.float(), dim=-1)
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


# ------------------------------------------------------------------------------- target features
@torch.no_grad()
def target_features(target: PreTrainedModel, input_ids: torch.LongTensor, layer_ids: list[int]):
    """(context features (L, m*d), final hidden (L, d)) of one sequence, fp16 on CPU."""
    out = target.base_model(input_ids=input_ids[None].to(target.device), output_hidden_states=True)
    hidden = out.hidden_states
    context = torch.cat([hidden[i][0] for i in hidden_state_indices(layer_ids)], dim=-1)
    return context.half().cpu(), out.last_hidden_state[0].half().cpu()


def build_feature_cache(target: PreTrainedModel, records: list[dict], layer_ids: list[int], path: Path,
                        max_seq_len: int, with_target_lse: bool = False) -> list[dict]:
    """Sequences with their target features, cached at ``path`` (recomputed if missing).

    ``with_target_lse`` (a reduced draft vocabulary) also stores the target's log-normaliser per
    position (``target_lse``), adding it to an existing cache that lacks it."""
    if path.exists():
        # memory-mapped: runs trained side by side on one cache share its pages instead of a copy each
        cached = torch.load(path, weights_only=True, mmap=True)
        if cached["layer_ids"] == list(layer_ids) and len(cached["items"]) == len(records):
            if with_target_lse:
                ensure_target_lse(cached["items"], target.get_output_embeddings(), path, layer_ids)
            return cached["items"]
    items = []
    for record in tqdm(records, desc="Target features", unit="seq"):
        ids = torch.tensor((record["prompt_ids"] + record["answer_ids"])[:max_seq_len])
        context, final = target_features(target, ids, layer_ids)
        items.append({"ids": ids, "answer_start": len(record["prompt_ids"]), "context": context, "final": final})
    if with_target_lse:
        add_target_lse(items, target.get_output_embeddings())
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"layer_ids": list(layer_ids), "items": items}, path)
    return items


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
    logits = base_logits
    if draft.markov_head is not None:
        head = draft.markov_head
        state = head.initial_state(previous.shape[0], hidden.device, hidden.dtype)
        biases = []
        for k in range(previous.shape[1]):
            bias, state = head.step(previous[:, k], hidden[:, k], state)
            biases.append(bias)
        logits = logits + torch.stack(biases, dim=1)
    confidence = None
    if draft.confidence_head is not None:
        confidence = confidence_logits(draft, hidden, previous)
    return logits, confidence


def step_loss(draft, target_head, item, anchors, cfg: TrainingConfig) -> dict[str, torch.Tensor]:
    base, hidden, previous, labels = draft_block_outputs(draft, item, anchors)
    draft_logits, confidence = serial_logits_teacher_forced(draft, base, hidden, previous)
    final = item["final"].to(hidden.device, torch.float32)
    label_positions = anchors.to(hidden.device)[:, None] + torch.arange(cfg.block_size, device=hidden.device) + 1
    if draft.draft_vocab_ids is not None:  # exact loss from the subset and the cached normaliser
        with torch.no_grad():
            target_logits = target_subset_logits(draft, target_head, final[label_positions - 1])
        lse = item["target_lse"].to(hidden.device)[label_positions - 1]
        return reduced_vocab_loss(draft_logits, target_logits, lse, labels, draft.draft_vocab_ids, confidence,
                                  weights=position_weights(cfg.block_size, hidden.device), ce_weight=cfg.ce_weight,
                                  tv_weight=cfg.tv_weight, conf_weight=cfg.conf_weight)
    with torch.no_grad():
        target_logits = target_head(final[label_positions - 1])
    return dspark_loss(draft_logits, target_logits, labels, confidence, ce_weight=cfg.ce_weight,
                       tv_weight=cfg.tv_weight, conf_weight=cfg.conf_weight)


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
    if cfg.init_from_draft:
        init_from_saved_draft(draft, cfg.init_from_draft)
    elif cfg.init_from_target:
        init_from_target_layers(draft, target)
    return draft


@torch.no_grad()
def init_from_saved_draft(draft: DSparkDraftModel, path: str | Path) -> None:
    """Starts training from a saved draft's weights (a warm start, e.g. v1 -> v2 on more data).

    The saved draft must have this run's architecture; its embedding and LM head, when saved, are
    ignored because training borrows the target's frozen ones. One difference is allowed: a
    full-vocabulary draft may start a reduced-vocabulary one (``draft_vocab_ids``), whose N-wide
    ``markov_w2`` then starts from the saved rows of those ids.
    """
    saved = DSparkDraftModel.from_pretrained(path, torch_dtype=torch.float32)
    narrowing = saved.draft_vocab_ids is None and draft.draft_vocab_ids is not None
    for key in ("block_size", "num_hidden_layers", "markov_rank", "markov_head_type", "target_layer_ids",
                "enable_confidence_head", "confidence_head_with_markov", "hidden_size", "vocab_size",
                "draft_vocab_size"):
        mine, theirs = getattr(draft.config, key, None), getattr(saved.config, key, None)
        if mine != theirs and not (narrowing and key == "draft_vocab_size"):
            raise ValueError(f"--init-from-draft {path}: its {key} is {theirs!r} but this run trains {mine!r}; "
                             "pass training options that match the saved draft, or start without it.")
    weights = {k: v for k, v in saved.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}
    if narrowing:
        weights["draft_vocab_ids"] = draft.draft_vocab_ids
        if "markov_head.markov_w2.weight" in weights:
            weights["markov_head.markov_w2.weight"] = weights["markov_head.markov_w2.weight"][draft.draft_vocab_ids]
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "lm_head."))]
    if missing or unexpected:
        raise ValueError(f"--init-from-draft {path}: weights do not fit (missing {missing}, unexpected {unexpected}).")
    logger.warning(f"Warm start from {path}.")


@torch.no_grad()
def init_from_target_layers(draft: DSparkDraftModel, target: PreTrainedModel) -> None:
    """Starts the draft from the target's last layers instead of random weights.

    Draft layer i copies target layer ``L - n + i`` where shapes agree (attention, MLP, norms;
    q_norm/k_norm stay at ones when the target has none), the final norm copies the target's,
    and ``fc`` starts as the identity on the deepest selected target layer, so the context
    features begin as that layer's (normed) hidden states.
    """
    target_layers = target.base_model.layers
    offset = len(target_layers) - len(draft.layers)
    for i, layer in enumerate(draft.layers):
        source = dict(target_layers[offset + i].named_parameters())
        for name, param in layer.named_parameters():
            if name in source and source[name].shape == param.shape:
                param.copy_(source[name].float())
    target_norm = getattr(target.base_model, "norm", None)
    if target_norm is not None and target_norm.weight.shape == draft.norm.weight.shape:
        draft.norm.weight.copy_(target_norm.weight.float())
    d = draft.config.hidden_size
    draft.fc.weight.zero_()
    draft.fc.weight[:, -d:] = torch.eye(d)


def train(target: PreTrainedModel, items: list[dict], cfg: TrainingConfig, output_dir: str | Path,
          resume: bool = False) -> DSparkDraftModel:
    """Trains a fresh draft on ``items`` (from :func:`build_feature_cache`) and saves it to ``output_dir``.

    ``output_dir/checkpoint`` holds the accelerate state every ``save_every`` steps; ``resume``
    continues from it. ``output_dir/train_log.jsonl`` gets one line per ``log_every`` steps.
    With ``snapshot_every``, ``output_dir/snapshots/step-N`` holds the draft after N steps, loadable
    with ``from_pretrained`` (so accepted length can be measured along the run, not only at its end).
    """
    from accelerate import Accelerator

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "training_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    torch.manual_seed(cfg.seed)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    target.requires_grad_(False)
    target_head = target.get_output_embeddings()
    draft = make_draft(target, cfg, choose_draft_vocab(target, items, cfg) if cfg.draft_vocab_size else None)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)

    def lr_lambda(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    draft, optimizer, scheduler = accelerator.prepare(draft, optimizer, scheduler)
    accelerator.register_for_checkpointing(scheduler)
    unwrapped = accelerator.unwrap_model(draft)
    unwrapped.bind_target(target)

    start_step = 0
    checkpoint = output_dir / "checkpoint"
    if resume and checkpoint.is_dir():
        accelerator.load_state(str(checkpoint))
        start_step = json.loads((checkpoint / "step.json").read_text())["step"]
        logger.warning(f"Resuming from step {start_step}.")
    generator = torch.Generator().manual_seed(cfg.seed + start_step)
    log = (output_dir / "train_log.jsonl").open("a" if resume else "w")
    draft.train()
    bar = tqdm(range(start_step, cfg.max_steps), desc="Training draft", disable=not accelerator.is_main_process)
    window: list[dict[str, torch.Tensor]] = []  # per-step metrics since the last log line
    for step in bar:
        picks = torch.randint(len(items), (cfg.sequences_per_step,), generator=generator).tolist()
        losses, parts = [], []
        for index in picks:
            item = items[index]
            anchors = sample_anchors(item["ids"].numel(), item["answer_start"], cfg.anchors_per_sequence,
                                     cfg.block_size, generator)
            if anchors.numel() == 0:
                continue
            out = step_loss(unwrapped, target_head, item, anchors, cfg)
            losses.append(out["loss"])
            parts.append(out)
        if not losses:
            continue
        loss = torch.stack(losses).mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        keys = ("ce", "tv", "bce", "accuracy") + (("label_outside_share",) if "label_outside_share" in parts[0] else ())
        window.append({key: torch.stack([p[key] for p in parts]).mean(0) for key in keys} | {"loss": loss.detach()})
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps:
            means = {key: torch.stack([w[key] for w in window]).mean(0) for key in window[0]}
            acc = means.pop("accuracy").tolist()
            record = {"step": step + 1, "lr": scheduler.get_last_lr()[0], "time": time.time(),
                      **{k: float(v) for k, v in means.items()}, "accuracy_per_position": acc}
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{acc[0]:.2f}")
            window = []
        if cfg.snapshot_every and (step + 1) % cfg.snapshot_every == 0 and step + 1 < cfg.max_steps:
            draft.eval()
            unwrapped.save_pretrained(output_dir / "snapshots" / f"step-{step + 1}")
            draft.train()
        if (step + 1) % cfg.save_every == 0 and step + 1 < cfg.max_steps:
            accelerator.save_state(str(checkpoint))
            (checkpoint / "step.json").write_text(json.dumps({"step": step + 1}))
    log.close()
    draft.eval()
    unwrapped.save_pretrained(output_dir)
    return unwrapped


def choose_draft_vocab(target: PreTrainedModel, items: list[dict], cfg: TrainingConfig) -> torch.LongTensor:
    """The ``cfg.draft_vocab_size`` most frequent answer tokens of ``items`` plus the special ids
    (:func:`dspark_hf.training.draft_vocab_training.select_draft_vocab`); makes sure every item has its
    ``target_lse`` (computed here when missing) and logs the training-answer coverage."""
    tokens = answer_tokens(items)
    ids = select_draft_vocab(token_counts(tokens, target.config.get_text_config().vocab_size), cfg.draft_vocab_size,
                             special_token_ids(target, cfg.mask_token_id))
    add_target_lse(items, target.get_output_embeddings())
    logger.warning(f"Draft vocabulary: {ids.numel()} ids hold {coverage(ids, tokens):.2%} of the training answer "
                   "tokens; cross-entropy skips labels outside it (label_outside_share in the log).")
    return ids
