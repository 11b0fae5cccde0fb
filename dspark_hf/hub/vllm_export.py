"""Writing a DSpark draft in the layout vLLM 0.34.0 serves, and saying why when it cannot.

``export(draft, folder, format="vllm", target=target)`` lands here. vLLM serves DeepSpec-style
drafts (``architectures: ["Qwen3DSparkModel"]``, ``model_type: "qwen3"``) with its
``Qwen3DSparkForCausalLM`` class; the facts below were read from the vLLM 0.34.0 wheel (paths are
inside it) and are pinned by ``tests/test_vllm_contract.py`` and its fixture
``tests/fixtures/vllm/qwen3_dspark_0.34.0.json``:

* ``vllm/model_executor/models/registry.py``: ``Qwen3DSparkModel`` -> ``qwen3_dspark.Qwen3DSparkForCausalLM``;
  ``DSparkDraftModel`` (this library's ``hf`` layout) -> the DeepSeek-V4 DSpark class, so the ``hf``
  folder is not a vLLM route.
* ``vllm/model_executor/models/qwen3_dspark.py``: the Markov head has only ``markov_w1`` (vocab x r)
  and ``markov_w2`` (draft vocab x r); ``lm_head`` has ``draft_vocab_size`` rows; a draft vocabulary
  smaller than the target's needs ``d2t`` (draft id i -> target id ``i + d2t[i]``), and without it
  every draft id maps to itself; the confidence head runs in fp32 with a bias.
* ``vllm/model_executor/models/qwen3_dflash.py``: the loader's stacked-parameter rules rename
  ``.gate_proj`` to ``.gate_up_proj`` anywhere in a name (a gated head's ``markov_head.gate_proj``
  then fails to load); an unknown name fails to load; the MLP (``qwen2.Qwen2MLP``) supports only
  ``silu``.
* ``vllm/v1/worker/gpu/spec_decode/dspark/speculator.py`` and ``dspark/config.py``:
  ``sample_from_anchor`` defaults to True when absent (the anchor's output is the first draft);
  ``vllm/transformers_utils/configs/speculators/algos.py`` defaults it to False for
  speculators-format configs, so this writer always writes it. ``confidence_temperatures`` is read
  nowhere; the confidence head is used only with ``"enable_adaptive_verification": true``.
* ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``: the target must expose auxiliary hidden
  states (``SupportsEagle3``); ``target_layer_ids`` become auxiliary layers ``id + 1``.

Drafts without a Markov head (DFlash, ``markov_rank == 0``) are written with a rank-1 head of
zeros: vLLM's class always builds a Markov head, and a zero head adds exactly 0 to every logit, so
drafting is unchanged while no zero-width tensor reaches vLLM's kernels.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, Qwen3Config

if TYPE_CHECKING:
    from ..model.modeling_dspark import DSparkDraftModel

VLLM_VERSION = "0.34.0"
VLLM_ARCHITECTURE = "Qwen3DSparkModel"
VLLM_MODEL_CLASS = "Qwen3DSparkForCausalLM"
VLLM_MODEL_FILE = "vllm/model_executor/models/qwen3_dspark.py"
D2T_NAME = "d2t"

# Architectures in vLLM 0.34.0's text-generation registry (vllm/model_executor/models/registry.py)
# whose class does not implement SupportsEagle3, the auxiliary hidden-state interface DSpark reads
# (set_eagle3_aux_hidden_state_layers raises "Model does not support EAGLE3 interface"). Read from
# the wheel's class hierarchy; architectures vLLM serves with its Transformers backend have it.
VLLM_TARGETS_WITHOUT_AUX_HIDDEN_STATES = frozenset("""
AXK1ForCausalLM AliceAIForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM BailingMoeV2_5ForCausalLM
BailingMoeV3ForCausalLM BeamForCausalLM BloomForCausalLM ChatGLMForConditionalGeneration ChatGLMModel
Cohere2ForCausalLM CohereForCausalLM DbrxForCausalLM DeciLMForCausalLM DeepseekV32ForCausalLM
DeepseekV4ForCausalLM DomynEdgeForCausalLM DoryForCausalLM Ernie4_5_MoeForCausalLM Exaone4ForCausalLM
ExaoneForCausalLM ExaoneMoEForCausalLM ExaoneMoeForCausalLM FalconForCausalLM FalconH1ForCausalLM
FalconMambaForCausalLM FlintForCausalLM GPT2LMHeadModel GPTJForCausalLM Gemma2ForCausalLM Gemma3ForCausalLM
Gemma3nForCausalLM Glm4ForCausalLM Glm4MoeForCausalLM Glm4MoeLiteForCausalLM Glm5NextForCausalLM
GraniteMoeHybridForCausalLM HCXVisionV2ForCausalLM HYV3ForCausalLM HYV4ForCausalLM HrmTextForCausalLM
HyperCLOVAXForCausalLM IQuestLoopCoderForCausalLM InklingForCausalLM InklingForConditionalGeneration
InternLM2ForCausalLM JambaForCausalLM KimiLinearForCausalLM Lfm2ForCausalLM Lfm2MoeForCausalLM Lfm3ForCausalLM
LongcatFlashForCausalLM LongcatFlashNgramForCausalLM Mamba2ForCausalLM MambaForCausalLM
MiniMaxM3SparseForCausalLM MistralLarge4ForCausalLM MixtralForCausalLM NemotronForCausalLM OPTForCausalLM
OlmoHybridForCausalLM OrionForCausalLM PanguEmbeddedForCausalLM PanguProMoEV2ForCausalLM
PanguUltraMoEForCausalLM Param2MoEForCausalLM PhiMoEForCausalLM Qwen2MoeForCausalLM Qwen4ExpForCausalLM
Rnj1ForCausalLM SarvamMoEForCausalLM SolarForCausalLM Step3TextForCausalLM Step3p5ForCausalLM
Step5ForCausalLM Zamba2ForCausalLM ZayaForCausalLM
""".split())

_NOT_SERVED = f"vLLM {VLLM_VERSION} cannot serve this draft"

# Draft fields written to config.json: those vLLM reads (the contract test lists them with their
# sources) and those dspark_hf reads back (num_target_layers, num_anchors, token ids, ...). The
# DeepSpec export writes the same ones; this module keeps its own list so that it does not import
# draft_export, which dispatches here.
_CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "attention_bias", "attention_dropout",
    "bos_token_id", "eos_token_id", "pad_token_id",
    "num_target_layers", "target_layer_ids", "block_size", "mask_token_id", "num_anchors", "enable_confidence_head",
    "confidence_head_with_markov",
)


def _fields(draft_or_config: Any) -> dict:
    """The draft fields this module reads, from a draft, a config object or a ``config.json`` dict
    (absent fields take :class:`~dspark_hf.DSparkConfig`'s defaults)."""
    config = getattr(draft_or_config, "config", draft_or_config)
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    return {
        "markov_rank": get("markov_rank", 256) or 0,
        "markov_head_type": get("markov_head_type", "vanilla"),
        "hidden_act": get("hidden_act", "silu"),
        "confidence_temperatures": get("confidence_temperatures", None),
        "enable_confidence_head": bool(get("enable_confidence_head", True)),
        "layer_types": list(get("layer_types", None) or []),
    }


def target_architecture(target: PreTrainedModel) -> str:
    """The architecture name vLLM would look up for ``target``: its config's first
    ``architectures`` entry, else its class name."""
    architectures = getattr(target.config, "architectures", None) or []
    return str(architectures[0]) if architectures else type(target).__name__


def vllm_compatibility(draft_or_config: Any, target: PreTrainedModel | None = None, *,
                       drop_confidence_temperatures: bool = False) -> str | None:
    """Why vLLM 0.34.0 cannot serve this draft from ``export(..., format="vllm")``, or ``None`` when it can.

    Args:
        draft_or_config: a :class:`~dspark_hf.DSparkDraftModel`, its config, or a ``config.json``
            dict (``hf`` or DeepSpec layout).
        target: the target model; when given, its architecture and LM head are checked too.
        drop_confidence_temperatures: accept a calibrated draft, whose temperatures vLLM ignores.

    The reason is a sentence naming the field, its value and what in vLLM refuses it.
    """
    f = _fields(draft_or_config)
    if f["markov_rank"] > 0 and f["markov_head_type"] == "gated":
        return (f"{_NOT_SERVED}: its Markov head is markov_head_type='gated'. vLLM's {VLLM_MODEL_CLASS} "
                f"({VLLM_MODEL_FILE}) has only markov_w1/markov_w2, and its loader's stacked-parameter rule renames "
                "markov_head.gate_proj to markov_head.gate_up_proj, which does not exist, so loading fails. Only "
                "vanilla Markov heads (or none) are served; run this draft with dspark_hf (format='hf' or 'deepspec').")
    if f["markov_rank"] > 0 and f["markov_head_type"] == "rnn":
        return (f"{_NOT_SERVED}: its Markov head is markov_head_type='rnn'. vLLM's {VLLM_MODEL_CLASS} "
                f"({VLLM_MODEL_FILE}) has only markov_w1/markov_w2 and no recurrent state, so loading "
                "markov_head.joint_proj fails. Only vanilla Markov heads (or none) are served; run this draft with "
                "dspark_hf (format='hf' or 'deepspec').")
    if f["hidden_act"] != "silu":
        return (f"{_NOT_SERVED}: its layers use hidden_act={f['hidden_act']!r} (copied from its target), and the "
                f"draft MLP of vLLM's {VLLM_MODEL_CLASS} (Qwen2MLP, vllm/model_executor/models/qwen2.py) supports only "
                "'silu' and raises for anything else.")
    sliding = sorted({t for t in f["layer_types"] if t != "full_attention"})
    if sliding:
        return (f"{_NOT_SERVED}: it has {sliding} draft layers (layer_types). vLLM derives the window and the "
                "causality of such layers by its own rules (_resolve_layer_attention in "
                "vllm/model_executor/models/qwen3_dflash.py), which dspark_hf has not matched to its own; only "
                "full-attention drafts are exported for vLLM.")
    if f["confidence_temperatures"] is not None and f["enable_confidence_head"] and not drop_confidence_temperatures:
        return (f"{_NOT_SERVED} as calibrated: it has per-position confidence_temperatures, which vLLM never reads (it "
                "takes the sigmoid of the raw confidence logit), so vLLM's adaptive verification would schedule from "
                "uncalibrated confidences. Pass drop_confidence_temperatures=True (command line: "
                "--drop-confidence-temperatures) to export it without them; drafting is unchanged.")
    if target is not None:
        arch = target_architecture(target)
        if arch in VLLM_TARGETS_WITHOUT_AUX_HIDDEN_STATES:
            return (f"{_NOT_SERVED} with this target: vLLM {VLLM_VERSION} implements {arch} without the auxiliary "
                    "hidden-state interface (SupportsEagle3) that DSpark drafting reads, and stops with \"Model does "
                    "not support EAGLE3 interface\".")
        head = target.get_output_embeddings()
        borrows_head = getattr(draft_or_config, "lm_head", 0) is None
        if borrows_head and getattr(head, "bias", None) is not None:
            return (f"{_NOT_SERVED} with this target: the draft uses the target's LM head, which has a bias, and "
                    f"the lm_head of vLLM's {VLLM_MODEL_CLASS} has none (a bias in the checkpoint is ignored).")
    return None


def vllm_serve_command(target_id: str, draft_folder: str, block_size: int) -> str:
    """The ``vllm serve`` command for a folder written by ``export(..., format="vllm")``."""
    return (f"vllm serve {target_id} \\\n"
            f"  --speculative-config '{{\"method\": \"dspark\", \"model\": \"{draft_folder}\", "
            f"\"num_speculative_tokens\": {block_size}}}'")


def _vllm_config_dict(draft: DSparkDraftModel, markov_rank: int) -> dict:
    """``config.json`` for vLLM: a Qwen3 config with every backbone and DSpark field written out."""
    c = draft.config
    fields = {field: copy.deepcopy(getattr(c, field)) for field in _CONFIG_FIELDS}
    config = Qwen3Config(**fields).to_diff_dict()
    config.update(fields)  # written even when equal to the defaults: vLLM 0.34 reads them with transformers < 5.23
    config.update(
        model_type="qwen3",
        architectures=[VLLM_ARCHITECTURE],
        num_hidden_layers=c.num_hidden_layers,
        layer_types=["full_attention"] * c.num_hidden_layers,
        use_sliding_window=False,
        tie_word_embeddings=False,
        dtype=str(draft.fc.weight.dtype).removeprefix("torch."),
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        # vLLM's name for which block outputs are drafts; its default depends on the config format, so always written.
        sample_from_anchor=c.anchor_predicts,
        anchor_predicts=c.anchor_predicts,  # dspark_hf's name for the same fact, read when it reloads the folder
    )
    if c.draft_vocab_size is not None:
        config["draft_vocab_size"] = c.draft_vocab_size
    for key in ("auto_map", "_name_or_path", "confidence_temperatures"):
        config.pop(key, None)
    return config


def _vllm_state_dict(draft: DSparkDraftModel, target: PreTrainedModel, embeddings: bool | None) -> dict:
    """The weights under the names vLLM's loader maps: no ``draft_vocab_ids``; ``d2t`` and an N-row
    ``lm_head`` for a reduced vocabulary; a zero rank-1 Markov head for a draft without one."""
    dtype = draft.fc.weight.dtype
    state = {key: value.detach().to("cpu").contiguous() for key, value in draft.state_dict().items()}
    ids = state.pop("draft_vocab_ids", None)
    own = draft.embed_tokens is not None and draft.lm_head is not None
    write_copies = own if embeddings is None else embeddings
    embed = draft.embed_tokens if draft.embed_tokens is not None else target.get_input_embeddings()
    head = draft.lm_head if draft.lm_head is not None else target.get_output_embeddings()
    state.pop("embed_tokens.weight", None)
    state.pop("lm_head.weight", None)
    if write_copies:
        # clone: a tied target shares one tensor between both, and each must be a separate copy on disk
        state["embed_tokens.weight"] = embed.weight.detach().to("cpu", dtype).clone().contiguous()
    if ids is not None:
        # vLLM maps draft id i to target id i + d2t[i]; its lm_head has one row per draft id.
        state[D2T_NAME] = (ids - torch.arange(ids.numel())).to(torch.int64).contiguous()
        state["lm_head.weight"] = head.weight.detach().to("cpu", dtype).index_select(0, ids).contiguous()
    elif write_copies:
        state["lm_head.weight"] = head.weight.detach().to("cpu", dtype).clone().contiguous()
    if draft.config.markov_rank == 0:
        rows = draft.config.draft_vocab_size or draft.config.vocab_size
        state["markov_head.markov_w1.weight"] = torch.zeros(draft.config.vocab_size, 1, dtype=dtype)
        state["markov_head.markov_w2.weight"] = torch.zeros(rows, 1, dtype=dtype)
    return state


def export_vllm(
    draft: DSparkDraftModel,
    save_directory: str | Path,
    *,
    target: PreTrainedModel | None,
    embeddings: bool | None = None,
    drop_confidence_temperatures: bool = False,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Writes ``draft`` as vLLM 0.34.0's ``Qwen3DSparkForCausalLM`` loads it; returns the folder.

    Files: ``config.json`` (``model_type: "qwen3"``, ``architectures: ["Qwen3DSparkModel"]``, the
    backbone and DSpark fields, ``sample_from_anchor`` always, ``draft_vocab_size`` for a reduced
    vocabulary) and ``model.safetensors``. Serve it with ``vllm serve <target> --speculative-config
    '{"method": "dspark", "model": "<folder>", "num_speculative_tokens": <block_size>}'``.

    Args:
        target: required: its architecture is checked, and its embedding/LM head supply copies.
        embeddings: write ``embed_tokens``/``lm_head`` copies. ``None``: as the draft has them (a
            draft that borrows them gets the target's in vLLM too). A reduced vocabulary always
            gets its N-row ``lm_head``, which vLLM cannot take from a target of another size.
        drop_confidence_temperatures: export a calibrated draft without its temperatures (vLLM
            ignores them); refused otherwise.

    Raises:
        ValueError: naming the reason, for what :func:`vllm_compatibility` refuses, a missing
            target, or ``embeddings=False`` with a reduced vocabulary.
    """
    if target is None:
        raise ValueError("format='vllm' needs target=<the target model>: vLLM serves the draft next to it, its "
                         "architecture must expose auxiliary hidden states, and it supplies borrowed weights.")
    reason = vllm_compatibility(draft, target, drop_confidence_temperatures=drop_confidence_temperatures)
    if reason is not None:
        raise ValueError(reason)
    if embeddings is False and draft.config.draft_vocab_size is not None:
        raise ValueError("embeddings=False is not possible for a reduced draft vocabulary in format='vllm': vLLM needs "
                         "the draft's own lm_head with draft_vocab_size rows (it shares only a head of the target's size).")
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    rank = draft.config.markov_rank or 1  # see the module docstring: a zero rank-1 head for DFlash drafts
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(_vllm_state_dict(draft, target, embeddings), folder, max_shard_size=max_shard_size,
                          metadata={"format": "pt"})
    config = _vllm_config_dict(draft, rank)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


__all__ = ["D2T_NAME", "VLLM_ARCHITECTURE", "VLLM_TARGETS_WITHOUT_AUX_HIDDEN_STATES", "VLLM_VERSION",
           "export_vllm", "target_architecture", "vllm_compatibility", "vllm_serve_command"]
