"""What a fresh draft reads from a target of any transformers family (:meth:`DSparkDraftModel.from_target`).

Target configs name their sizes differently: GPT-2 says ``n_embd``/``n_layer``/``n_head``/``n_inner``,
OPT ``ffn_dim``, Falcon ``ffn_hidden_size``. The standard names (``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``vocab_size``) are read through the config's
``attribute_map`` (plain ``getattr`` on the text config from ``get_text_config()``); the MLP width has no
standard alias, so its family spellings are tried in turn.

Only four sizes must come from the target: the vocabulary and the width are shared (the draft reads
the target's hidden states and uses its embedding table and LM head), and the number of layers and
heads place the conditioning layers and shape the draft like the target. The rest (MLP width,
activation, norm epsilon, rotary settings) are the draft's own choice and only follow the target
where it says them in a form the draft's Qwen3-style layers can use.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.utils import logging

logger = logging.get_logger(__name__)

REQUIRED_TARGET_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# MLP width, by family: Llama/Qwen/Mistral/Gemma/Phi/GPT-NeoX, GPT-2, OPT, Falcon.
INTERMEDIATE_SIZE_NAMES = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")


def _read(config: Any, name: str) -> Any:
    """``config.<name>`` through its attribute map, or None when the family has no such field."""
    try:
        return getattr(config, name)
    except AttributeError:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _draft_rope_parameters(rope: Any) -> dict | None:
    """The target's rotary settings in the form the draft's rotary embedding reads, or None (default RoPE).

    Per-layer-type settings (``{"full_attention": {...}, "sliding_attention": {...}}``) give the
    full-attention ones, as every draft layer attends fully. ``partial_rotary_factor`` is dropped: the
    draft rotates its whole head (its scaling-aware rope types would otherwise build frequencies for
    part of the head only and fail on the shape).
    """
    if not isinstance(rope, dict) or not rope:
        return None
    if "rope_type" not in rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    if "rope_type" not in rope:
        return None
    return {k: v for k, v in rope.items() if k != "partial_rotary_factor"}


def draft_backbone_fields(target: PreTrainedModel) -> dict[str, Any]:
    """DSparkConfig backbone fields for a draft of ``target`` (sizes, heads, rotary and special tokens).

    Raises ``ValueError`` naming what is unsupported: a config without one of
    :data:`REQUIRED_TARGET_SIZES`, no LM head, or embeddings narrower or wider than the hidden
    states (OPT-350m's ``project_in``/``project_out``): the draft works at the target's hidden width
    with the target's own embedding table and LM head.
    """
    tc = target.config.get_text_config()
    family = f"{type(tc).__name__} (model_type {getattr(tc, 'model_type', None)!r})"
    missing = [name for name in REQUIRED_TARGET_SIZES if not _is_int(_read(tc, name))]
    if missing:
        raise ValueError(
            f"DSparkDraftModel.from_target cannot read {missing} from the target's config {family}: the draft "
            "needs the target's vocabulary size, hidden width, number of layers and attention heads. Build a "
            "DSparkConfig with those fields by hand and use DSparkDraftModel(config)."
        )
    hidden, heads = tc.hidden_size, tc.num_attention_heads
    _check_embedding_widths(target, hidden, family)

    intermediate = next((v for v in map(lambda n: _read(tc, n), INTERMEDIATE_SIZE_NAMES) if _is_int(v)), None)
    if intermediate is None:  # GPT-2 (n_inner None) and Falcon mean 4 x hidden by it
        intermediate = 4 * hidden
        logger.info("The target config %s gives no MLP width; the draft uses 4 x hidden_size = %d.", family,
                    intermediate)
    kv_heads = _read(tc, "num_key_value_heads")
    if not _is_int(kv_heads) or kv_heads < 1 or heads % kv_heads:
        kv_heads = heads
    head_dim = _read(tc, "head_dim")
    if not _is_int(head_dim) or head_dim < 1:
        head_dim = hidden // heads
    act = _read(tc, "hidden_act")
    eps = _read(tc, "rms_norm_eps")
    max_positions = _read(tc, "max_position_embeddings")
    fields = dict(
        vocab_size=tc.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        # The draft's own activation; the target's when the draft's MLP can use it.
        hidden_act=act if isinstance(act, str) and act in ACT2FN else "silu",
        rms_norm_eps=float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else 1e-6,
        rope_parameters=_draft_rope_parameters(_read(tc, "rope_parameters")),
        bos_token_id=_read(tc, "bos_token_id"),
        eos_token_id=_read(tc, "eos_token_id"),
        pad_token_id=_read(tc, "pad_token_id"),
        num_target_layers=tc.num_hidden_layers,
    )
    if _is_int(max_positions) and max_positions > 0:
        fields["max_position_embeddings"] = max_positions
    return fields


def _check_embedding_widths(target: PreTrainedModel, hidden: int, family: str) -> None:
    embed: nn.Module | None = target.get_input_embeddings()
    head: nn.Module | None = target.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(
            f"The target {family} has no LM head (get_output_embeddings() is None); DSpark drafts a causal LM's "
            "next tokens. Use a ...ForCausalLM model as the target."
        )
    for what, module in (("input embeddings", embed), ("LM head", head)):
        width = module.weight.shape[1] if getattr(module, "weight", None) is not None else None
        if width != hidden:
            raise ValueError(
                f"The target {family} has {what} of width {width} but hidden states of width {hidden} (a projection "
                "between them, as in OPT-350m); a DSpark draft works at the hidden width with the target's "
                "embedding table and LM head, so this target is not supported."
            )


__all__ = ["INTERMEDIATE_SIZE_NAMES", "REQUIRED_TARGET_SIZES", "draft_backbone_fields"]
