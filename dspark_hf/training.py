"""Training DSpark / DFlash drafts for any transformers causal LM (paper section 3.3).

Recipe: the target is frozen; the draft shares (and freezes) the target's embedding and LM head.
Each training sequence (a prompt answered by the target itself, see :mod:`dspark_hf.data`)
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
CLI: ``python -m dspark_hf.training --help``.
"""

from __future__ import annotations

import argparse
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

from .draft_vocab import scatter_to_vocab
from .draft_vocab_training import (add_target_lse, answer_tokens, coverage, ensure_target_lse, reduced_vocab_loss,
                                   select_draft_vocab, special_token_ids, target_subset_logits, token_counts)
from .modeling_dspark import DSparkDraftModel, default_target_layer_ids

logger = logging.get_logger(__name__)


@dataclass
class TrainingConfig:
    """Everything that defines a training run (saved as ``training_config.json``)."""

    block_size: int = 7
    num_hidden_layers: int = 1
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_head_with_markov: bool = True
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
    acceptance = 1.0 - 0.5 * tv
    total = ce_weight * ce + tv_weight * tv
    bce = torch.zeros_like(tv)
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(
            confidence_logits.float(), acceptance.detach().clamp(0.0, 1.0), reduction="none"
        )
        total = total + conf_weight * bce
    loss = (total * weights).sum(-1).mean()
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
    context = torch.cat([hidden[i + 1][0] for i in layer_ids], dim=-1)
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
        features = draft.markov_head.markov_w1(previous) if draft.confidence_head.with_markov else None
        confidence = draft.confidence_head.logits(hidden, features)
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
    if cfg.init_from_draft:
        init_from_saved_draft(draft, cfg.init_from_draft)
    elif cfg.init_from_target:
        init_from_target_layers(draft, target)
    return draft


@torch.no_grad()
def init_from_saved_draft(draft: DSparkDraftModel, path: str | Path) -> None:
    """Starts training from a saved draft's weights (a warm start, e.g. v1 -> v2 on more data).

    The saved draft must have this run's architecture; its embedding and LM head, when saved, are
    ignored because training borrows the target's frozen ones.
    """
    saved = DSparkDraftModel.from_pretrained(path, torch_dtype=torch.float32)
    for key in ("block_size", "num_hidden_layers", "markov_rank", "markov_head_type", "target_layer_ids",
                "enable_confidence_head", "confidence_head_with_markov", "hidden_size", "vocab_size",
                "draft_vocab_size"):
        mine, theirs = getattr(draft.config, key, None), getattr(saved.config, key, None)
        if mine != theirs:
            raise ValueError(f"--init-from-draft {path}: its {key} is {theirs!r} but this run trains {mine!r}; "
                             "pass training options that match the saved draft, or start without it.")
    weights = {k: v for k, v in saved.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}
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
        if (step + 1) % cfg.save_every == 0 and step + 1 < cfg.max_steps:
            accelerator.save_state(str(checkpoint))
            (checkpoint / "step.json").write_text(json.dumps({"step": step + 1}))
    log.close()
    draft.eval()
    unwrapped.save_pretrained(output_dir)
    return unwrapped


# --------------------------------------------------------------------------------- evaluation
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


def choose_draft_vocab(target: PreTrainedModel, items: list[dict], cfg: TrainingConfig) -> torch.LongTensor:
    """The ``cfg.draft_vocab_size`` most frequent answer tokens of ``items`` plus the special ids
    (:func:`dspark_hf.draft_vocab_training.select_draft_vocab`); makes sure every item has its
    ``target_lse`` (computed here when missing) and logs the training-answer coverage."""
    tokens = answer_tokens(items)
    ids = select_draft_vocab(token_counts(tokens, target.config.get_text_config().vocab_size), cfg.draft_vocab_size,
                             special_token_ids(target, cfg.mask_token_id))
    add_target_lse(items, target.get_output_embeddings())
    logger.warning(f"Draft vocabulary: {ids.numel()} ids hold {coverage(ids, tokens):.2%} of the training answer "
                   "tokens; cross-entropy skips labels outside it (label_outside_share in the log).")
    return ids


def main(argv: list[str] | None = None) -> None:
    """CLI: data (ShareGPT prompts answered by SmolLM2) -> target features -> training -> STS -> save."""
    from .calibration import calibrate_draft
    from .data import generate_answers, load_corpus, sharegpt_prompts, sharegpt_reference_answers
    from .datagen import load_onpolicy_corpus, load_plan
    from .scheduler import default_cache_dir
    from .smollm2 import load_smollm2, mask_token_id

    parser = argparse.ArgumentParser(prog="python -m dspark_hf.training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="draft output folder")
    parser.add_argument("--corpus", default=None,
                        help="JSONL corpus (default: <cache>/data/sharegpt_smollm2.jsonl), or a folder made by "
                             "`python -m dspark_hf.datagen` (its finished shards are used as they are)")
    parser.add_argument("--max-sequences", type=int, default=None,
                        help="use only the first N records of a datagen folder (the feature cache holds ~4.6 KB "
                             "per token for SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=320)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--reference-answers", type=int, default=0,
                        help="add this many ShareGPT conversations with their original answers (no generation)")
    parser.add_argument("--markov-rank", type=int, default=64)
    parser.add_argument("--no-confidence-head", action="store_true")
    parser.add_argument("--max-steps", type=int, default=800)
    parser.add_argument("--learning-rate", type=float, default=TrainingConfig.learning_rate)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--init-from-draft", default=None,
                        help="warm start from a saved draft folder with the same architecture")
    parser.add_argument("--save-every", type=int, default=TrainingConfig.save_every)
    parser.add_argument("--prepare-only", action="store_true", help="only build the corpus and the feature cache")
    parser.add_argument("--fp16", action="store_true", help="save the draft in fp16")
    parser.add_argument("--draft-vocab-size", type=int, default=0,
                        help="reduced draft vocabulary: the N most frequent answer tokens (0 = the full vocabulary)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.prepare_only and not args.output:
        parser.error("--output is required unless --prepare-only")

    target, tokenizer = load_smollm2()
    corpus = Path(args.corpus) if args.corpus else default_cache_dir() / "data" / "sharegpt_smollm2.jsonl"
    if corpus.is_dir():  # on-policy shards from dspark_hf.datagen; nothing to generate here
        records = load_onpolicy_corpus(corpus)[: args.max_sequences]
        prompts = [p["text"] for p in load_plan(corpus) if p["source"] == "sharegpt"]
        tag = f"n{len(records)}"
        logger.warning(f"Training corpus: {len(records)} records of {corpus}")
        # features live in the cache, not next to the shards (they are ~1000x larger)
        corpus = default_cache_dir() / "data" / f"{corpus.resolve().name}.jsonl"
    else:
        prompts = sharegpt_prompts(limit=args.num_prompts)
        generate_answers(target, tokenizer, prompts, corpus, max_new_tokens=args.max_new_tokens, batch_size=32)
        records = sorted((r for r in load_corpus(corpus) if r["index"] < args.num_prompts), key=lambda r: r["index"])
        tag = f"n{args.num_prompts}"
    if args.reference_answers:
        reference = corpus.with_name(f"sharegpt_reference.n{args.reference_answers}.jsonl")
        sharegpt_reference_answers(tokenizer, args.reference_answers, reference, exclude_prompts=set(prompts),
                                   max_answer_tokens=args.max_new_tokens)
        records += load_corpus(reference)  # after the target's own answers: the held-out split stays on-policy
        tag += f".ref{args.reference_answers}"
    cfg = TrainingConfig(markov_rank=args.markov_rank, max_steps=args.max_steps, learning_rate=args.learning_rate,
                         confidence_head=not args.no_confidence_head,
                         confidence_head_with_markov=not args.no_confidence_head and args.markov_rank > 0,
                         mask_token_id=mask_token_id(tokenizer), init_from_draft=args.init_from_draft,
                         save_every=args.save_every, draft_vocab_size=args.draft_vocab_size or None)
    cfg.target_layer_ids = default_target_layer_ids(target.config.num_hidden_layers, cfg.num_hidden_layers)
    tokens = sum(min(len(r["prompt_ids"]) + len(r["answer_ids"]), cfg.max_seq_len) for r in records)
    feature_gb = tokens * (len(cfg.target_layer_ids) + 1) * target.config.hidden_size * 2 / 1e9
    logger.warning(f"Feature cache: {len(records)} sequences, {tokens} tokens, ~{feature_gb:.1f} GB, held in memory "
                   "while training (--max-sequences caps it).")
    feature_path = corpus.with_name(f"{corpus.stem}.{tag}.layers{'-'.join(map(str, cfg.target_layer_ids))}.pt")
    items = build_feature_cache(target, records, cfg.target_layer_ids, feature_path, cfg.max_seq_len,
                                with_target_lse=bool(cfg.draft_vocab_size))
    if args.prepare_only:
        return
    held_out, train_items = items[: cfg.held_out_sequences], items[cfg.held_out_sequences :]
    draft = train(target, train_items, cfg, args.output, resume=args.resume)
    if draft.confidence_head is not None:
        report = calibrate_draft(draft, target, held_out, Path(args.output))
        logger.warning(f"Calibration: ECE before {report['ece_before']}, after {report['ece_after']}")
    if args.fp16:
        draft.half()
    draft.save_pretrained(args.output)


if __name__ == "__main__":
    main()
