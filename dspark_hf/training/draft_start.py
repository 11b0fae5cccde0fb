"""Where a fresh draft starts: the target's own layers and norms where they compute what the draft's
would (:func:`init_from_target_layers`), or a saved draft (:func:`init_from_saved_draft`, a warm start).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from ..model.modeling_dspark import DSparkDraftModel

logger = logging.get_logger(__name__)


@torch.no_grad()
def init_from_saved_draft(draft: DSparkDraftModel, path: str | Path) -> None:
    """Starts training from a saved draft's weights (a warm start, e.g. v1 -> v2 on more data).

    The saved draft must have this run's architecture; its embedding and LM head, when saved, are
    ignored because training borrows the target's frozen ones. Two differences are allowed: a
    full-vocabulary draft may start a reduced-vocabulary one (``draft_vocab_ids``), whose N-wide
    ``markov_w2`` then starts from the saved rows of those ids; and a draft may start a deeper one
    (``--draft-layers`` above the saved count). Its layers become the first ones and each added layer
    keeps its start (the target's layers) with its attention and MLP output projections zeroed, so the
    added residual blocks are identities and the deeper draft starts out drafting exactly as the
    saved one.
    """
    saved = DSparkDraftModel.from_pretrained(path, torch_dtype=torch.float32)
    narrowing = saved.draft_vocab_ids is None and draft.draft_vocab_ids is not None
    saved_depth, depth = saved.config.num_hidden_layers, draft.config.num_hidden_layers
    deepening = saved_depth < depth and list(saved.config.layer_types) == list(draft.config.layer_types)[:saved_depth]
    for key in ("block_size", "num_hidden_layers", "markov_rank", "markov_head_type", "target_layer_ids",
                "enable_confidence_head", "confidence_head_with_markov", "hidden_size", "vocab_size",
                "draft_vocab_size"):
        mine, theirs = getattr(draft.config, key, None), getattr(saved.config, key, None)
        if mine != theirs and not (narrowing and key == "draft_vocab_size") and not (
                deepening and key == "num_hidden_layers"):
            raise ValueError(f"--init-from-draft {path}: its {key} is {theirs!r} but this run trains {mine!r}; "
                             "pass training options that match the saved draft (a deeper draft may start from a "
                             "shallower one), or start without it.")
    weights = {k: v for k, v in saved.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}
    added = tuple(f"layers.{i}." for i in range(saved_depth, depth)) if deepening else ()
    for prefix in added:
        for name, param in draft.named_parameters():
            if name.startswith(prefix) and name.endswith(("o_proj.weight", "o_proj.bias", "down_proj.weight",
                                                          "down_proj.bias")):
                weights[name] = torch.zeros_like(param)
    if (not narrowing and draft.draft_vocab_ids is not None
            and not torch.equal(saved.draft_vocab_ids, draft.draft_vocab_ids)):
        logger.warning(f"--init-from-draft {path}: training keeps that draft's {saved.draft_vocab_ids.numel()}-id "
                       "vocabulary (its Markov head's rows belong to those ids), not the one chosen from this data.")
    if narrowing:
        weights["draft_vocab_ids"] = draft.draft_vocab_ids
        if "markov_head.markov_w2.weight" in weights:
            weights["markov_head.markov_w2.weight"] = weights["markov_head.markov_w2.weight"][draft.draft_vocab_ids]
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "lm_head.") + added)]
    if missing or unexpected:
        raise ValueError(f"--init-from-draft {path}: weights do not fit (missing {missing}, unexpected {unexpected}).")
    logger.warning(f"Warm start from {path}.")


def _decoder_layers(target: PreTrainedModel) -> nn.ModuleList | None:
    """The target's list of decoder layers (``layers`` in Llama-like families, ``h`` in GPT-2/Falcon,
    ``decoder.layers`` in OPT): the module list with one entry per hidden layer."""
    count = target.config.get_text_config().num_hidden_layers
    for module in target.base_model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    return None


def _final_norm(target: PreTrainedModel, width: int) -> nn.Module | None:
    """The target's final norm module (``norm``, ``ln_f``, ``final_layer_norm``...), if it has one of ``width``."""
    for name, module in target.base_model.named_modules():
        if name.split(".")[-1] in ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm"):
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.shape == (width,):
                return module
    return None


def _copy_norm(draft_norm: nn.Module, target_norm: nn.Module) -> str | None:
    """Makes ``draft_norm`` (``w * x / rms(x)``) compute what ``target_norm`` computes, when one of the
    conventions families store it in does: the weight itself (Llama, Qwen) or ``1 + w`` (Gemma's
    offsets). Checked on a probe; returns the convention used, or None (``draft_norm`` unchanged)."""
    weight = getattr(target_norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != draft_norm.weight.shape:
        return None
    probe = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device)
    expected = target_norm(probe.to(weight.dtype)).float()
    saved = draft_norm.weight.detach().clone()
    for convention, value in (("w", weight.float()), ("1 + w", 1.0 + weight.float())):
        draft_norm.weight.copy_(value)
        if torch.allclose(draft_norm(probe.to(draft_norm.weight.dtype)).float(), expected, rtol=1e-3, atol=1e-4):
            return convention
    draft_norm.weight.copy_(saved)
    return None


def _layer_copy_refusal(draft_layer: nn.Module, target_layer: nn.Module, target: PreTrainedModel) -> str | None:
    """Why target layer ``target_layer`` cannot start ``draft_layer`` (None when it can): it must hold the
    same weights (pre-norm attention and a gated MLP, no extra norms) and use SiLU, as the draft does."""
    config = target.config.get_text_config()
    activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if activation != "silu":
        return f"its MLP uses {activation!r}, the draft's SiLU"
    mine = {name for name, _ in draft_layer.named_parameters()}
    theirs = {name for name, _ in target_layer.named_parameters() if not name.endswith(".bias")}
    extra = sorted(theirs - mine)
    if extra:
        return f"it has weights the draft layer lacks ({', '.join(extra[:3])}): another layer layout"
    return None


@torch.no_grad()
def init_from_target_layers(draft: DSparkDraftModel, target: PreTrainedModel) -> dict[str, str]:
    """Starts the draft from the target's last layers instead of random weights, where that is exact.

    Draft layer i copies target layer ``L - n + i`` when the two compute the same thing: the target
    layer holds the draft layer's weights and nothing else (no extra norms) and its MLP uses SiLU, as
    Llama-like families do; every norm (input, post-attention, q/k and the final norm) is copied in
    the convention that reproduces the target's output on a probe (``w``, or Gemma's ``1 + w``). A
    layer or norm that no convention reproduces keeps its fresh start, logged. ``fc`` starts as the
    identity on the deepest selected target layer, so the context features begin as that layer's
    (normed) hidden states. Returns what was done per part (for the log and the card).
    """
    report: dict[str, str] = {}
    target_layers = _decoder_layers(target)
    if target_layers is not None:
        offset = len(target_layers) - len(draft.layers)
        for i, layer in enumerate(draft.layers):
            source_layer = target_layers[offset + i]
            refusal = _layer_copy_refusal(layer, source_layer, target)
            if refusal:
                report[f"layer {i}"] = f"fresh (target layer {offset + i} not copied: {refusal})"
                continue
            source = dict(source_layer.named_parameters())
            norms = {name for name, module in layer.named_modules() if name and hasattr(module, "variance_epsilon")}
            for name, param in layer.named_parameters():
                module_name = name.rsplit(".", 1)[0]
                if module_name in norms:
                    continue
                if name in source and source[name].shape == param.shape:
                    param.copy_(source[name].float())
            kept = []
            for name in sorted(norms):
                target_norm = source_layer.get_submodule(name) if name in dict(source_layer.named_modules()) else None
                if target_norm is None or _copy_norm(layer.get_submodule(name), target_norm) is None:
                    kept.append(name)
            report[f"layer {i}"] = f"target layer {offset + i}" + (f" (fresh {', '.join(kept)})" if kept else "")
    norm = _final_norm(target, draft.norm.weight.shape[0])
    convention = _copy_norm(draft.norm, norm) if norm is not None else None
    report["final norm"] = f"target's, stored as {convention}" if convention else "fresh (no target norm reproduced)"
    d = draft.config.hidden_size
    draft.fc.weight.zero_()
    draft.fc.weight[:, -d:] = torch.eye(d)
    fresh = [part for part, what in report.items() if what.startswith("fresh")]
    if fresh:
        logger.warning("Draft start: " + "; ".join(f"{part}: {report[part]}" for part in fresh))
    return report


__all__ = ["init_from_saved_draft", "init_from_target_layers"]
