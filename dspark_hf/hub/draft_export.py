"""Writing DSpark drafts in a loadable layout: Hub-ready transformers folders, DeepSpec folders,
and uploads to the Hugging Face Hub.

Layouts (docs/formats.md describes how each loads):

* ``"hf"``: this library's transformers layout (``model_type: "dspark"``): ``config.json`` with
  ``auto_map``, thin remote-code files that re-export the installed ``dspark_hf`` classes,
  safetensors weights, ``custom_generate/`` and a ``README.md`` card. Loads with
  ``AutoModel.from_pretrained(repo, trust_remote_code=True)``, with ``AutoModel.from_pretrained(repo)``
  after ``import dspark_hf``, and with ``DSparkDraftModel.from_pretrained(repo)``.
* ``"deepspec"``: DeepSpec's released layout (``model_type: "qwen3"``, ``architectures:
  ["Qwen3DSparkModel"]``, no ``auto_map``) for vLLM/SGLang; loads with
  ``DSparkDraftModel.from_pretrained``.
* ``"vllm"``: the layout vLLM 0.34.0's ``Qwen3DSparkForCausalLM`` loads, or a ``ValueError`` saying
  why vLLM cannot serve the draft (:mod:`dspark_hf.hub.vllm_export`).

Weights are written as safetensors only, and nothing here touches the network except
:func:`push_to_hub`.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, Qwen3Config

from ..model.configuration_dspark import DSparkConfig, is_dspark_config
from .model_card import render_model_card
from .speculators_export import write_speculators
from .template_files import read_template

if TYPE_CHECKING:  # annotations only
    from ..model.modeling_dspark import DSparkDraftModel

FORMATS = ("hf", "deepspec", "vllm", "speculators")
AUTO_MAP = {"AutoConfig": "configuration_dspark.DSparkConfig", "AutoModel": "modeling_dspark.DSparkDraftModel"}
REMOTE_CODE_FILES = {  # file in the exported folder -> template in dspark_hf/hub/templates
    "configuration_dspark.py": "configuration_dspark.py",
    "modeling_dspark.py": "modeling_dspark.py",
    "custom_generate/generate.py": "custom_generate_generate.py",
    "custom_generate/requirements.txt": "requirements.txt",
}
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
# DSpark fields of a DeepSpec config.json (docs/design.md, section 6).
DEEPSPEC_FIELDS = (
    "num_target_layers",
    "target_layer_ids",
    "block_size",
    "mask_token_id",
    "num_anchors",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "markov_rank",
    "markov_head_type",
)
# Backbone fields the draft's config decides (copied over a target's Qwen3 config).
_BACKBONE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _export_state_dict(draft: DSparkDraftModel, target: PreTrainedModel | None, include_embeddings: bool) -> dict:
    """The draft's weights on CPU, with or without ``embed_tokens``/``lm_head`` (copied from the target when borrowed)."""
    dtype = draft.fc.weight.dtype
    state = {key: value.detach().to("cpu").contiguous() for key, value in draft.state_dict().items()}
    modules = {"embed_tokens": draft.embed_tokens, "lm_head": draft.lm_head}
    for name, own in modules.items():
        key = f"{name}.weight"
        if not include_embeddings:
            state.pop(key, None)
            continue
        if own is not None:
            continue
        if target is None:
            raise ValueError(
                f"This draft has no {name} of its own (it borrows the target's), and this export needs a copy: "
                "pass target=<the target model>."
            )
        borrowed = target.get_input_embeddings() if name == "embed_tokens" else target.get_output_embeddings()
        # clone: a tied target shares one tensor between both, and each must be a separate copy on disk
        state[key] = borrowed.weight.detach().to("cpu", dtype).clone().contiguous()
    return state


def _save_weights(state: dict, folder: Path, max_shard_size) -> None:
    from huggingface_hub import save_torch_state_dict

    # save_torch_state_dict removes earlier shards itself and writes model.safetensors (+ index when sharded)
    save_torch_state_dict(state, folder, max_shard_size=max_shard_size, metadata={"format": "pt"})


def _hf_config_dict(draft: DSparkDraftModel) -> dict:
    c = draft.config
    config = c.to_diff_dict()  # what save_pretrained writes, plus every field a reader should see
    config.update({field: copy.deepcopy(getattr(c, field)) for field in _BACKBONE_FIELDS + DEEPSPEC_FIELDS})
    config.update(
        num_hidden_layers=c.num_hidden_layers,
        anchor_predicts=c.anchor_predicts,
        confidence_temperatures=copy.deepcopy(c.confidence_temperatures),
        model_type=DSparkConfig.model_type,
        architectures=["DSparkDraftModel"],
        auto_map=dict(AUTO_MAP),
        dtype=_dtype_name(draft.fc.weight.dtype),
    )
    if c.draft_vocab_size is not None:  # a reduced draft vocabulary; its ids are in the weights
        config["draft_vocab_size"] = c.draft_vocab_size
    config.pop("_name_or_path", None)
    return config


def _deepspec_config_dict(draft: DSparkDraftModel, target: PreTrainedModel | None) -> dict:
    """A DeepSpec ``config.json``: the target's Qwen3 config (or one built from the draft) plus the DSpark fields."""
    c = draft.config
    if not c.anchor_predicts:
        raise ValueError(
            "This draft drafts at the mask positions (z-lab DFlash layout, anchor_predicts=False); the DeepSpec "
            "layout has no field for that, and an engine reading it would draft at the wrong positions. Export it "
            "with format='hf'."
        )
    if c.draft_vocab_size is not None:
        raise ValueError(
            f"This draft has a reduced draft vocabulary (draft_vocab_size={c.draft_vocab_size}, draft_vocab_ids in "
            "its weights); the DeepSpec layout has no field for it, and an engine reading it would take the "
            "N-wide markov_w2 for a full-vocabulary one. Export it with format='hf'."
        )
    if "sliding_attention" in list(c.layer_types)[: c.num_hidden_layers]:
        raise ValueError(f"This draft has sliding-window layers (layer_types={c.layer_types}); the DeepSpec layout "
                         "drafts with full attention. Export it with format='speculators' or format='hf'.")
    base = None
    if target is not None:
        text_config = target.config.get_text_config()
        if text_config.model_type == "qwen3":
            base = text_config.to_diff_dict()
    if base is None:
        base = Qwen3Config(**{field: getattr(c, field) for field in _BACKBONE_FIELDS}).to_diff_dict()
    base.update({field: copy.deepcopy(getattr(c, field)) for field in _BACKBONE_FIELDS})
    base.update({field: copy.deepcopy(getattr(c, field)) for field in DEEPSPEC_FIELDS})
    if c.confidence_temperatures is not None:  # our calibration; absent from DeepSpec's own files
        base["confidence_temperatures"] = list(c.confidence_temperatures)
    base.update(
        model_type="qwen3",
        architectures=[DEEPSPEC_ARCHITECTURE],
        num_hidden_layers=c.num_hidden_layers,
        layer_types=["full_attention"] * c.num_hidden_layers,
        use_sliding_window=False,
        tie_word_embeddings=False,
        dtype=_dtype_name(draft.fc.weight.dtype),
    )
    rope = c.rope_parameters or {}
    if "rope_theta" in rope:
        # transformers 4.x readers (some serving engines) know only the legacy keys; 5.x reads either
        base["rope_theta"] = rope["rope_theta"]
        base["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else copy.deepcopy(dict(rope))
    for key in ("auto_map", "_name_or_path", "anchor_predicts"):
        base.pop(key, None)
    return base


def _default_base_model(target: PreTrainedModel | None) -> str | None:
    """The target's Hub id when it was loaded from one (not from a local folder)."""
    name = getattr(getattr(target, "config", None), "_name_or_path", "") or ""
    if name.count("/") == 1 and not os.path.exists(name) and not name.startswith((".", "/", "~")):
        return name
    return None


def export(
    draft: DSparkDraftModel,
    save_directory: str | os.PathLike,
    *,
    format: str = "hf",
    target: PreTrainedModel | None = None,
    embeddings: bool | None = None,
    model_card: bool | None = None,
    base_model: str | None = None,
    repo_id: str | None = None,
    measured: dict | None = None,
    training: dict | None = None,
    license: str = "apache-2.0",
    max_shard_size: int | str = "5GB",
    drop_confidence_temperatures: bool = False,
) -> Path:
    """Writes ``draft`` to ``save_directory`` in a loadable layout and returns the folder.

    Args:
        format: ``"hf"`` (default): Hub-ready transformers layout: ``config.json`` (``model_type:
            "dspark"``, ``auto_map``), ``configuration_dspark.py``/``modeling_dspark.py`` (thin
            re-exports of ``dspark_hf``), safetensors weights, ``custom_generate/generate.py`` +
            ``requirements.txt`` and a ``README.md`` model card. ``"deepspec"``: exactly DeepSpec's
            layout for serving engines: a Qwen3 ``config.json`` with ``architectures:
            ["Qwen3DSparkModel"]`` and the DSpark fields, and safetensors weights including
            ``embed_tokens`` and ``lm_head`` copies; nothing else unless ``model_card=True``.
            ``"speculators"``: vllm-project/speculators' format (:mod:`dspark_hf.hub.speculators_export`),
            naming ``base_model`` (default: the target's name) as its verifier.
        target: the target model. Checked against the draft; needed when a copy of a borrowed
            embedding/LM head is written; its Qwen3 config is the base of a DeepSpec
            ``config.json``; its Hub id is the card's default ``base_model``.
        embeddings: write ``embed_tokens``/``lm_head``. ``None``: as the draft has them (``"hf"``),
            always (``"deepspec"``, which needs them).
        model_card: write ``README.md``; default True for ``"hf"``, False for ``"deepspec"``.
        base_model, repo_id, measured, training, license: passed to :func:`render_model_card`.
        max_shard_size: safetensors shard size (huggingface_hub's ``save_torch_state_dict``).
        drop_confidence_temperatures: ``"vllm"`` only (see :func:`dspark_hf.hub.vllm_export.export_vllm`),
            which writes the layout vLLM 0.34.0 serves, or refuses with the reason.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    # Recognised by its config, as everywhere in dspark_hf (a draft loaded through Hub remote code
    # is the same class, but the check must not need the model module, which imports this one).
    if not (isinstance(draft, PreTrainedModel) and is_dspark_config(draft.config)):
        raise TypeError(f"export needs a DSparkDraftModel, got {type(draft).__name__}.")
    if target is not None:
        draft.check_target(target)
    if format == "vllm":
        from .vllm_export import export_vllm  # imports this module

        if model_card:
            raise ValueError("format='vllm' writes no model card; export format='hf' for the Hub card.")
        return export_vllm(draft, save_directory, target=target, embeddings=embeddings,
                           drop_confidence_temperatures=drop_confidence_temperatures, max_shard_size=max_shard_size)
    if format == "speculators":  # vllm-project/speculators' format (hub/speculators_export.py)
        return write_speculators(draft, save_directory, target=target, base_model=base_model, embeddings=embeddings,
                                 model_card=model_card, max_shard_size=max_shard_size)
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    has_own = draft.embed_tokens is not None and draft.lm_head is not None
    if format == "deepspec":
        if embeddings is False:
            raise ValueError("The DeepSpec layout stores embed_tokens and lm_head copies; embeddings=False is not possible.")
        include_embeddings = True
        config = _deepspec_config_dict(draft, target)
    else:
        include_embeddings = has_own if embeddings is None else embeddings
        config = _hf_config_dict(draft)
    state = _export_state_dict(draft, target, include_embeddings)
    _save_weights(state, folder, max_shard_size)
    _write_json(folder / "config.json", config)
    if format == "hf":
        for dest, template in REMOTE_CODE_FILES.items():
            path = folder / dest
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(read_template(template), encoding="utf-8")
    if model_card if model_card is not None else format == "hf":
        card = render_model_card(
            folder,
            measured,
            base_model=base_model or _default_base_model(target),
            repo_id=repo_id,
            training=training,
            license=license,
        )
        (folder / "README.md").write_text(card, encoding="utf-8")
    return folder


def push_to_hub(
    draft: DSparkDraftModel,
    repo_id: str,
    *,
    format: str = "hf",
    target: PreTrainedModel | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    api=None,
    **export_kwargs,
):
    """Exports ``draft`` (see :func:`export`) into a temporary folder and uploads it to ``repo_id``.

    Uses ``huggingface_hub.HfApi``: ``create_repo(repo_id, exist_ok=True)`` then ``upload_folder``;
    returns ``upload_folder``'s result (a ``CommitInfo``). ``api`` may be any object with those two
    methods (e.g. an ``HfApi`` with a custom endpoint). The card's snippets name ``repo_id``.
    """
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="dspark_export_") as tmp:
        export(draft, tmp, format=format, target=target, repo_id=repo_id, **export_kwargs)
        api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
        return api.upload_folder(
            folder_path=tmp,
            repo_id=repo_id,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or f"Upload DSpark draft ({format} layout) with dspark_hf",
            create_pr=create_pr,
        )


__all__ = ["AUTO_MAP", "DEEPSPEC_FIELDS", "FORMATS", "export", "push_to_hub"]
