"""Writing a draft in vllm-project/speculators' format (speculators 0.9), for speculators and vLLM.

What speculators 0.9 itself saves, field for field (``dspark_hf.model.speculators_format`` reads it back):

* ``config.json``: ``speculators_model_type`` (``"dspark"``; ``"dflash"`` for a draft with neither
  Markov nor confidence head), ``architectures`` (``["DSparkDraftModel"]`` / ``["DFlashDraftModel"]``,
  the class names speculators writes), the decoder as a Qwen3 ``transformer_layer_config`` (draft
  layers, ``layer_types``, ``sliding_window``), ``draft_vocab_size``, ``block_size``,
  ``aux_hidden_state_layer_ids`` (our target layer ids + 1), ``mask_token_id``,
  ``sliding_window_non_causal``, ``sample_from_anchor`` (always written: readers disagree on its
  default), the Markov and confidence fields, and ``speculators_config`` (algorithm, a greedy proposal
  of ``block_size`` tokens, the verifier's name and architectures). Calibration temperatures, which
  speculators does not have, are kept as ``confidence_temperatures`` (speculators keeps unknown keys).
* ``model.safetensors``: our weight names, without ``embed_tokens`` (speculators always takes the
  verifier's) and, for the full vocabulary, without ``lm_head`` (likewise). A reduced vocabulary is
  written as speculators keeps it: ``d2t`` (int64 offsets, ``id - arange(N)``), ``t2d`` (V booleans)
  and ``lm_head`` holding the N target rows.

speculators' own loader reads the result with every weight identical (checked by
``tests/fixtures/speculators/regenerate.py``, recorded in ``roundtrip.json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, Qwen3Config

if TYPE_CHECKING:
    from ..model.modeling_dspark import DSparkDraftModel

__all__ = ["SPECULATORS_VERSION", "speculators_config_dict", "speculators_state_dict", "write_speculators"]

SPECULATORS_VERSION = "0.9.0"  # the format written (and checked against)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _verifier(target: PreTrainedModel | None, base_model: str | None) -> tuple[str, list[str]]:
    """The verifier's name (Hub id or folder) and architectures, which speculators loads it by."""
    config = getattr(target, "config", None)
    name = base_model or getattr(config, "_name_or_path", None) or None
    if not name:
        raise ValueError(
            "A speculators checkpoint names its verifier (speculators reloads the embedding and LM head from it): "
            "pass target=<the target model> loaded from its Hub id or folder, or base_model=<its Hub id>."
        )
    return str(name), list(getattr(config, "architectures", None) or [])


def speculators_config_dict(draft: DSparkDraftModel, verifier_name: str, verifier_architectures: list[str]) -> dict:
    """The speculators ``config.json`` of ``draft`` (see the module docstring)."""
    c = draft.config
    kind = "dspark" if c.markov_rank > 0 or c.enable_confidence_head else "dflash"
    if not c.anchor_predicts and c.markov_rank > 0 and c.markov_head_type == "rnn":
        raise ValueError("This draft has an rnn Markov head and drafts at the mask positions (anchor_predicts=False); "
                         "speculators steps that head's state over the anchor slot first and would draft differently. "
                         "Export it with format='hf'.")
    layer_types = list(c.layer_types)[: c.num_hidden_layers]
    sliding = "sliding_attention" in layer_types
    layer = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.initializer_range,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters or {}) or None,
        attention_bias=c.attention_bias, attention_dropout=c.attention_dropout, tie_word_embeddings=False,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        use_sliding_window=sliding, sliding_window=c.sliding_window if sliding else None, layer_types=layer_types,
    ).to_diff_dict()
    layer.pop("transformers_version", None)
    tokens = c.block_size  # drafted per round; speculators' block is one longer when the anchor predicts nothing
    config = {
        "architectures": ["DSparkDraftModel" if kind == "dspark" else "DFlashDraftModel"],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name, "architectures": verifier_architectures},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
        "block_size": c.block_size if c.anchor_predicts else c.block_size + 1,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": not c.sliding_block_causal,
        "sample_from_anchor": bool(c.anchor_predicts),
        "tie_word_embeddings": False,
        "dtype": _dtype_name(draft.fc.weight.dtype),
    }
    if kind == "dspark":
        config.update(markov_rank=c.markov_rank, markov_head_type=c.markov_head_type,
                      enable_confidence_head=c.enable_confidence_head,
                      confidence_head_with_markov=c.confidence_head_with_markov)
    if c.confidence_temperatures is not None:
        config["confidence_temperatures"] = list(c.confidence_temperatures)
    return config


def _same_as_target(own: torch.nn.Module, borrowed: torch.nn.Module | None, name: str) -> None:
    """speculators always replaces ``name`` by the verifier's, so a draft's own copy must equal it."""
    if borrowed is None:
        raise ValueError(
            f"This draft has its own {name}; speculators replaces it with the verifier's on load, so the export "
            "checks that they are equal: pass target=<the target model>."
        )
    theirs = borrowed.weight.detach().to("cpu", own.weight.dtype)
    if not torch.equal(own.weight.detach().to("cpu"), theirs):
        raise ValueError(
            f"This draft's own {name} differs from the target's; speculators replaces it with the verifier's on "
            "load and would draft differently. Export it with format='hf' instead."
        )


def speculators_state_dict(draft: DSparkDraftModel, target: PreTrainedModel | None) -> dict[str, torch.Tensor]:
    """The draft's weights as speculators stores them (see the module docstring), on CPU."""
    from ..model.draft_vocab import BUFFER_NAME

    dtype = draft.fc.weight.dtype
    skip = {"embed_tokens.weight", "lm_head.weight", BUFFER_NAME}
    state = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items() if k not in skip}
    target_embed = target.get_input_embeddings() if target is not None else None
    target_head = target.get_output_embeddings() if target is not None else None
    if draft.embed_tokens is not None:
        _same_as_target(draft.embed_tokens, target_embed, "embed_tokens")
    ids = draft.draft_vocab_ids
    if ids is None:
        if draft.lm_head is not None:
            _same_as_target(draft.lm_head, target_head, "lm_head")
        return state
    head = draft.lm_head if draft.lm_head is not None else target_head
    if head is None:
        raise ValueError("A reduced draft vocabulary is written with its LM-head rows (lm_head, N rows), and this "
                         "draft borrows the target's head: pass target=<the target model>.")
    ids = ids.detach().to("cpu").long()
    weight = head.weight.detach().to("cpu", dtype)
    t2d = torch.zeros(draft.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    state.update({"lm_head.weight": weight.index_select(0, ids).contiguous(),
                  "d2t": ids - torch.arange(ids.numel()), "t2d": t2d})
    return state


def write_speculators(
    draft: DSparkDraftModel,
    folder: str | os.PathLike,
    *,
    target: PreTrainedModel | None = None,
    base_model: str | None = None,
    embeddings: bool | None = None,
    model_card: bool | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Writes ``draft`` to ``folder`` in speculators' format (``config.json`` + safetensors weights).

    ``base_model`` (default: the target's ``_name_or_path``) is the verifier speculators loads the
    embedding and LM head from. Raises ``ValueError`` for what the format cannot hold: stored
    embeddings (``embeddings=True``), a model card, an own embedding/LM head that differs from the
    target's.
    """
    from huggingface_hub import save_torch_state_dict

    if embeddings:
        raise ValueError("speculators checkpoints never store embed_tokens (nor a full-vocabulary lm_head): "
                         "speculators loads them from the verifier. Leave embeddings unset.")
    if model_card:
        raise ValueError("format='speculators' writes no model card (speculators has none); leave model_card unset.")
    name, architectures = _verifier(target, base_model)
    state = speculators_state_dict(draft, target)
    config = speculators_config_dict(draft, name, architectures)
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(state, path, max_shard_size=max_shard_size, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
