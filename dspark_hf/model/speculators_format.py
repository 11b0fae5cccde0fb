"""Reading DSpark and DFlash drafts saved by vllm-project/speculators (format of speculators 0.9).

speculators writes no ``model_type``; its ``config.json`` has ``speculators_model_type``
(``"dspark"`` or ``"dflash"`` here), ``speculators_config`` (algorithm, proposal, verifier) and the
draft's decoder config nested in ``transformer_layer_config``. Its weights use our names except:

* ``d2t`` (N offsets: draft id ``i`` is target id ``i + d2t[i]``) and ``t2d`` (V booleans) for a
  reduced vocabulary; we store the ids themselves (``draft_vocab_ids``);
* ``lm_head`` is stored only for a reduced vocabulary, as the N target rows (speculators freezes it
  and never trains it), and ``embed_tokens`` never; speculators reloads both from the verifier, as
  this library borrows the target's;
* ``aux_hidden_state_layer_ids`` count transformers' ``hidden_states`` entries (0 = embedding
  output), so our ``target_layer_ids`` are one less.

Facts read in speculators 0.9.0 (``models/dflash``, ``models/dspark``, ``model.py``, ``config.py``),
checked by the golden fixtures in ``tests/fixtures/speculators/`` that its own code produced.
Anything speculators would draft differently from this translation raises ``ValueError``.
(This module imports nothing of the package at import time: the config class uses it.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["SPECULATORS_DEFAULTS", "SPECULATORS_MARKERS", "is_speculators_config_dict",
           "translate_speculators_config", "translate_speculators_state_dict", "translated_state_dict"]

# Keys speculators writes into every config.json it saves (its own loader tells its checkpoints apart
# by the first one). The architecture names it writes clash with ours and z-lab's, so every layout
# check asks this first.
SPECULATORS_MARKERS = ("speculators_model_type", "speculators_config", "speculators_version")


def is_speculators_config_dict(config_dict: dict) -> bool:
    """True for a ``config.json`` dict written by vllm-project/speculators (any of its model types)."""
    return any(key in config_dict for key in SPECULATORS_MARKERS)

# speculators' field defaults (DFlashSpeculatorConfig / DSparkSpeculatorConfig, 0.9.0); its reader
# applies them to a config.json that lacks the field, and so do we. Note sample_from_anchor: True
# for "dspark", False for "dflash" (vLLM assumes otherwise for files lacking it; our writer always
# writes it).
SPECULATORS_DEFAULTS: dict[str, dict] = {
    "dflash": {"draft_vocab_size": 32000, "block_size": 8, "target_hidden_size": None,
               "aux_hidden_state_layer_ids": None, "mask_token_id": None, "sliding_window_non_causal": False,
               "sample_from_anchor": False},
}
SPECULATORS_DEFAULTS["dspark"] = {**SPECULATORS_DEFAULTS["dflash"], "sample_from_anchor": True, "markov_rank": 256,
                                  "markov_head_type": "vanilla", "enable_confidence_head": True,
                                  "confidence_head_with_markov": True}
# Keys that carry no drafting behaviour: speculators' bookkeeping, transformers' generic config keys,
# and our calibration temperatures (which our writer adds; speculators keeps unknown keys).
_INERT_KEYS = {"speculators_model_type", "speculators_config", "speculators_version", "transformer_layer_config",
               "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "tie_word_embeddings",
               "_name_or_path", "name_or_path", "model_type", "chunk_size_feed_forward", "id2label", "label2id",
               "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
               "use_cache", "confidence_temperatures",
               # generic PretrainedConfig keys older transformers versions write with to_dict()
               "add_cross_attention", "bad_words_ids", "begin_suppress_tokens", "cross_attention_hidden_size",
               "decoder_start_token_id", "finetuning_task", "is_decoder", "prefix", "pruned_heads", "sep_token_id",
               "task_specific_params", "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "torchscript",
               "use_bfloat16", "bos_token_id", "eos_token_id", "pad_token_id"}
# Verifier-owned weights speculators reloads from the verifier on every load (never trusted from the file).
_VERIFIER_KEYS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def _fail(name: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"{name} is a vllm-project/speculators checkpoint that dspark_hf cannot draft exactly as "
                      f"speculators does: {problem}. {fix}")


def _decoder_config(layer_config: dict, name: str):
    """The draft decoder config as speculators builds it: the class of its ``model_type``, else Qwen3."""
    from transformers import AutoConfig, Qwen3Config

    layer_config = dict(layer_config)
    model_type = layer_config.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **layer_config) if model_type else Qwen3Config(**layer_config)
    except (ValueError, KeyError, TypeError) as err:
        raise _fail(name, f"transformer_layer_config (model_type {model_type!r}) does not build: {err}",
                    "Check the config.json.") from err


def translate_speculators_config(config_dict: dict, name: str = "this checkpoint") -> dict:
    """A speculators ``config.json`` dict (DSpark or DFlash) as :class:`~dspark_hf.DSparkConfig` fields.

    Raises ``ValueError`` naming the field and value for what is not supported: other model types
    (DFlash2, EAGLE-3, MTP, ...), fields this library does not know, a ``target_hidden_size`` other
    than the draft's width, a missing mask token or target layers, partial or multimodal rotary
    embeddings, and a decoder without ``hidden_act``.
    """
    kind = config_dict.get("speculators_model_type")
    if kind not in SPECULATORS_DEFAULTS:
        raise _fail(name, f"speculators_model_type = {kind!r} (supported: {sorted(SPECULATORS_DEFAULTS)})",
                    "Use speculators' own code or vLLM for this draft type.")
    src = {**SPECULATORS_DEFAULTS[kind], **config_dict}
    unknown = sorted(set(src) - set(SPECULATORS_DEFAULTS[kind]) - _INERT_KEYS)
    if unknown:
        raise _fail(name, f"it has fields whose behaviour is not implemented here: {unknown}",
                    "Use speculators' own code, or a dspark_hf version that knows these fields.")
    algorithm = (src.get("speculators_config") or {}).get("algorithm", kind)
    if algorithm != kind:
        raise _fail(name, f"speculators_config.algorithm = {algorithm!r} but speculators_model_type = {kind!r}",
                    "Fix config.json so that both name the same algorithm.")
    layer = _decoder_config(src.get("transformer_layer_config") or {}, name)
    hidden_size, heads = int(layer.hidden_size), int(layer.num_attention_heads)
    for field in ("aux_hidden_state_layer_ids", "mask_token_id"):
        if src[field] is None:
            raise _fail(name, f"{field} is not set", f"Add \"{field}\" (the value it was trained with) to config.json.")
    if src["target_hidden_size"] not in (None, hidden_size):
        raise _fail(name, f"target_hidden_size = {src['target_hidden_size']} differs from the draft's hidden_size "
                    f"{hidden_size}", "dspark_hf drafts read target hidden states of the draft's own width.")
    hidden_act = getattr(layer, "hidden_act", None)
    if not isinstance(hidden_act, str):
        raise _fail(name, f"transformer_layer_config has no hidden_act (model_type {layer.model_type!r})",
                    "speculators' draft MLP reads hidden_act; add it to transformer_layer_config.")
    rope = dict(getattr(layer, "rope_parameters", None) or {})
    if "sliding_attention" in rope:  # speculators' flatten_rope_parameters: one rope for the draft
        rope = dict(rope["sliding_attention"])
    partial = rope.get("partial_rotary_factor", getattr(layer, "partial_rotary_factor", 1.0))
    if float(partial if partial is not None else 1.0) != 1.0 or "mrope_section" in rope:
        raise _fail(name, f"rope_parameters {rope} (partial or multimodal rotary embedding)",
                    "dspark_hf drafts rotate the whole head with one position per token.")
    layers = int(layer.num_hidden_layers)
    window = getattr(layer, "sliding_window", None)
    kinds = list(getattr(layer, "layer_types", None) or [])[:layers]
    # speculators masks a "sliding_attention" layer with the window only when sliding_window is set;
    # without one that layer attends like a full one.
    layer_types = ["sliding_attention" if t == "sliding_attention" and window is not None else "full_attention"
                   for t in kinds] + ["full_attention"] * (layers - len(kinds))
    vocab_size, draft_vocab = int(layer.vocab_size), int(src["draft_vocab_size"])
    if not 1 <= draft_vocab <= vocab_size:
        raise _fail(name, f"draft_vocab_size = {draft_vocab} outside [1, vocab_size={vocab_size}]",
                    "Fix config.json.")
    block = int(src["block_size"])
    anchor_predicts = bool(src["sample_from_anchor"])
    if not anchor_predicts and block < 2:
        raise _fail(name, f"block_size = {block} with sample_from_anchor = False drafts no token",
                    "Use block_size >= 2.")
    dspark = kind == "dspark"
    if dspark and not anchor_predicts and int(src["markov_rank"]) > 0 and src["markov_head_type"] == "rnn":
        # speculators runs the rnn state through the anchor slot first (its output unused); this
        # library drops that slot before the Markov loop, so the state would start elsewhere
        raise _fail(name, "markov_head_type = 'rnn' with sample_from_anchor = False (the recurrent state also steps "
                    "over the anchor slot)", "Use speculators' own code, or a draft with sample_from_anchor = True.")
    fields = {
        "architectures": ["DSparkDraftModel"],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(layer.intermediate_size),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(layer.num_key_value_heads or heads),
        "head_dim": int(getattr(layer, "head_dim", None) or hidden_size // heads),
        "hidden_act": hidden_act,
        "max_position_embeddings": int(layer.max_position_embeddings),
        "rms_norm_eps": float(layer.rms_norm_eps),
        "rope_parameters": rope or None,
        "attention_bias": bool(getattr(layer, "attention_bias", False)),
        "bos_token_id": getattr(layer, "bos_token_id", None),
        "eos_token_id": getattr(layer, "eos_token_id", None),
        "pad_token_id": getattr(layer, "pad_token_id", None),
        "tie_word_embeddings": False,
        "layer_types": layer_types,
        "sliding_window": int(window) if "sliding_attention" in layer_types else None,
        "sliding_block_causal": not bool(src["sliding_window_non_causal"]),
        # speculators' ids count hidden_states entries; ours count layers (-1 = embedding output);
        # the weights' fc columns are reordered to match when they are not increasing
        "target_layer_ids": sorted(int(i) - 1 for i in src["aux_hidden_state_layer_ids"]),
        "num_target_layers": None,  # speculators does not record the target's depth
        "block_size": block if anchor_predicts else block - 1,
        "anchor_predicts": anchor_predicts,
        "mask_token_id": int(src["mask_token_id"]),
        "markov_rank": int(src["markov_rank"]) if dspark else 0,
        "markov_head_type": src["markov_head_type"] if dspark else "vanilla",
        "enable_confidence_head": bool(src["enable_confidence_head"]) if dspark else False,
        "confidence_head_with_markov": bool(src["confidence_head_with_markov"]) if dspark else False,
        "confidence_temperatures": src.get("confidence_temperatures"),
        "draft_vocab_size": draft_vocab if draft_vocab < vocab_size else None,
    }
    if "dtype" in src or "torch_dtype" in src:
        fields["dtype"] = src.get("dtype") or src.get("torch_dtype")
    return fields


def translate_speculators_state_dict(state: dict[str, torch.Tensor], config_dict: dict,
                                     name: str = "this checkpoint") -> dict[str, torch.Tensor]:
    """A speculators state dict in :class:`~dspark_hf.DSparkDraftModel`'s names (a new dict).

    Drops the verifier-owned tensors speculators reloads from the verifier (``embed_tokens``,
    ``verifier_*``, and ``lm_head``: the full head, or the reduced head's N frozen target rows, which
    this library gathers from the target's head by ``draft_vocab_ids``); turns ``d2t``/``t2d`` into
    sorted ``draft_vocab_ids`` (reordering ``markov_w2``'s rows to match); reorders ``fc``'s column
    blocks when ``aux_hidden_state_layer_ids`` is not increasing.
    """
    fields = translate_speculators_config(config_dict, name)
    out = {key: value for key, value in state.items()
           if key not in _VERIFIER_KEYS + ("lm_head.weight", "d2t", "t2d")}
    vocab, size, hidden = fields["vocab_size"], fields["draft_vocab_size"], fields["hidden_size"]
    if size is not None:
        out.update(_draft_vocab_tensors(state, vocab, size, hidden, name))
    aux = [int(i) for i in {**SPECULATORS_DEFAULTS["dflash"], **config_dict}["aux_hidden_state_layer_ids"]]
    order = sorted(range(len(aux)), key=aux.__getitem__)
    if order != list(range(len(aux))) and "fc.weight" in out:
        blocks = out["fc.weight"].split(hidden, dim=1)
        out["fc.weight"] = torch.cat([blocks[i] for i in order], dim=1).contiguous()
    return out


def _draft_vocab_tensors(state: dict, vocab: int, size: int, hidden: int, name: str) -> dict[str, torch.Tensor]:
    """``draft_vocab_ids`` (and a row-matched ``markov_head.markov_w2``) from speculators' ``d2t``/``t2d``."""
    from .draft_vocab import BUFFER_NAME, draft_vocab_problem

    missing = [key for key in ("d2t", "t2d") if key not in state]
    if missing:
        raise _fail(name, f"draft_vocab_size = {size} < vocab_size = {vocab} but the weights have no {missing}",
                    "speculators itself needs them passed to from_pretrained(t2d=..., d2t=...); save them into "
                    "the checkpoint (model.load_vocab_mappings(t2d, d2t); model.save_pretrained(...)).")
    d2t, t2d = state["d2t"].long().flatten(), state["t2d"].bool().flatten()
    if d2t.numel() != size or t2d.numel() != vocab:
        raise _fail(name, f"d2t has {d2t.numel()} entries (draft_vocab_size {size}) and t2d {t2d.numel()} "
                    f"(vocab_size {vocab})", "Re-save the checkpoint with matching tensors.")
    ids = torch.arange(size) + d2t
    order = torch.argsort(ids)
    ids = ids[order]
    problem = draft_vocab_problem(ids, vocab, size)
    if problem is None and (int(t2d.sum()) != size or not bool(t2d[ids].all())):
        problem = "t2d does not mark exactly the ids arange(N) + d2t"
    if problem is not None:
        raise _fail(name, f"its reduced vocabulary (d2t/t2d) is inconsistent: {problem}",
                    "Re-save the checkpoint with speculators' own vocabulary mapping.")
    head = state.get("lm_head.weight")
    if head is not None and tuple(head.shape) != (size, hidden):
        raise _fail(name, f"lm_head.weight has shape {tuple(head.shape)}, expected ({size}, {hidden})",
                    "Check that config.json belongs to these weights.")
    out = {BUFFER_NAME: ids}
    if "markov_head.markov_w2.weight" in state:
        out["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][order].contiguous()
    return out


_DOWNLOAD_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


def _resolve(path, filename: str, kwargs: dict) -> str | None:
    """Local path of ``filename`` in a folder or Hub repo (downloaded once), ``None`` when absent."""
    from transformers.utils import cached_file

    folder = Path(path) / (kwargs.get("subfolder") or "")
    if os.path.isdir(path):
        return str(folder / filename) if (folder / filename).is_file() else None
    try:
        return cached_file(str(path), filename, _raise_exceptions_for_missing_entries=False,
                           **{k: kwargs[k] for k in _DOWNLOAD_KWARGS if kwargs.get(k) is not None})
    except OSError:
        return None


def translated_state_dict(path, kwargs: dict) -> dict[str, torch.Tensor] | None:
    """For a speculators checkpoint at ``path`` (folder or Hub id), its weights translated to our
    names; ``None`` for any other layout (the caller loads it as usual). ``kwargs`` are
    ``from_pretrained``'s (only the download options are read)."""
    from safetensors.torch import load_file

    if path is None or kwargs.get("state_dict") is not None:
        return None
    config_file = _resolve(path, "config.json", kwargs)
    if config_file is None:
        return None
    config_dict = json.loads(Path(config_file).read_text(encoding="utf-8"))
    if not is_speculators_config_dict(config_dict):
        return None
    name = str(path)
    index_file = _resolve(path, "model.safetensors.index.json", kwargs)
    if index_file is not None:
        shards = sorted(set(json.loads(Path(index_file).read_text(encoding="utf-8"))["weight_map"].values()))
        files = [_resolve(path, shard, kwargs) for shard in shards]
    else:
        files = [_resolve(path, "model.safetensors", kwargs)]
    if any(f is None for f in files):
        raise ValueError(f"{name} is a speculators checkpoint without (complete) safetensors weights "
                         "(model.safetensors or its shards); re-download or re-save it.")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return translate_speculators_state_dict(state, config_dict, name)
