"""Hugging Face Hub integration: auto-class registration, Hub-ready export, DeepSpec export,
``push_to_hub``, the ``custom_generate`` entry point and model cards.

Checkpoint formats and how they load (see also docs/formats.md):

* ``"dspark"``: this library's transformers layout (``model_type: "dspark"``). :func:`export`
  writes it Hub-ready: ``config.json`` with ``auto_map``, thin remote-code files that re-export the
  installed ``dspark_hf`` classes, safetensors weights, ``custom_generate/`` and a ``README.md``
  card. Loads with ``AutoModel.from_pretrained(repo, trust_remote_code=True)``, with
  ``AutoModel.from_pretrained(repo)`` after ``import dspark_hf``, and with
  ``DSparkDraftModel.from_pretrained(repo)``.
* ``"deepspec"``: DeepSpec's released layout (``model_type: "qwen3"``,
  ``architectures: ["Qwen3DSparkModel"]``, no ``auto_map``; DFlash drafts have ``markov_rank: 0``).
  Loads with ``DSparkDraftModel.from_pretrained``. After ``import dspark_hf`` every transformers
  auto class refuses it with that advice (without the import, ``AutoModel`` would silently build a
  plain Qwen3 model from it). ``export(..., format="deepspec")`` writes it for vLLM/SGLang.
* ``"zlab-dflash"``: z-lab DFlash drafts (``architectures: ["DFlashDraftModel"]``). Loads with
  ``DSparkDraftModel.from_pretrained`` with z-lab's drafting positions (see
  :func:`~dspark_hf.configuration_dspark.translate_zlab_dflash_config` for what is rejected).

Weights are read from safetensors only (transformers 5.x loads nothing else here) and nothing in
this module touches the network except :func:`push_to_hub` and the loaders it documents.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import os
import string
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, PreTrainedModel, Qwen3Config
from transformers.utils import logging

from .configuration_dspark import (
    DSPARK_ARCHITECTURE_SUFFIXES,
    DSparkConfig,
    is_dspark_config,
    is_zlab_dflash_config_dict,
)
from .modeling_dspark import DSparkDraftModel

logger = logging.get_logger(__name__)

FORMATS = ("hf", "deepspec")
AUTO_MAP = {"AutoConfig": "configuration_dspark.DSparkConfig", "AutoModel": "modeling_dspark.DSparkDraftModel"}
REMOTE_CODE_FILES = {  # file in the exported folder -> template in dspark_hf/hub_templates
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
CARD_TAGS = ["dspark", "speculative-decoding", "draft-model", "dflash"]
_GUARD_MARKER = "_dspark_auto_guard"


# ------------------------------------------------------------------------------ formats / auto
def checkpoint_format(config: dict | Any) -> str | None:
    """``"dspark"``, ``"deepspec"``, ``"zlab-dflash"`` or ``None`` for a config object or ``config.json`` dict."""
    if not isinstance(config, dict):
        config = {"model_type": getattr(config, "model_type", None), "architectures": getattr(config, "architectures", None)}
    if config.get("model_type") == "dspark":
        return "dspark"
    if is_zlab_dflash_config_dict(config):
        return "zlab-dflash"
    if any(str(a).endswith(DSPARK_ARCHITECTURE_SUFFIXES) for a in config.get("architectures") or []):
        return "deepspec"
    return None


def _is_foreign_dspark_config(config) -> bool:
    """A DSpark config carried by another config class (DeepSpec's Qwen3 layout)."""
    return not isinstance(config, DSparkConfig) and getattr(config, "model_type", None) != "dspark" and \
        is_dspark_config(config)


def _deepspec_auto_error(config) -> ValueError:
    name = getattr(config, "_name_or_path", "") or ""
    return ValueError(
        f"{name or 'This checkpoint'} is a DSpark draft in DeepSpec layout (model_type {config.model_type!r}, "
        f"architectures {config.architectures}). A transformers auto class would build a plain {config.model_type} "
        "model from it and drop the DSpark heads. Load it with "
        f"dspark_hf.DSparkDraftModel.from_pretrained({name or '<repo id or folder>'!r}) and pass it to the "
        "target's generate() as assistant_model."
    )


def register_auto_classes() -> None:
    """Registers the DSpark classes with ``AutoConfig``/``AutoModel`` and guards the auto classes
    against DeepSpec-layout drafts (idempotent; runs on ``import dspark_hf``).

    The guard wraps transformers' ``auto_factory._get_model_class``, which every auto class calls
    for a config it knows (``from_pretrained`` and ``from_config``); it raises for a config that
    declares a DSpark architecture under another ``model_type`` and changes nothing else.
    """
    AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
    AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)
    from transformers.models.auto import auto_factory

    original = getattr(auto_factory, "_get_model_class", None)
    if original is None:  # transformers moved it: loading still works, only the guard is missing
        logger.warning("dspark_hf: transformers' auto_factory._get_model_class is gone; DeepSpec-layout drafts "
                       "are not refused by the auto classes. Load them with DSparkDraftModel.from_pretrained.")
        return
    if getattr(original, _GUARD_MARKER, False):
        return

    @functools.wraps(original)
    def _get_model_class(config, model_mapping):
        if _is_foreign_dspark_config(config):
            raise _deepspec_auto_error(config)
        return original(config, model_mapping)

    setattr(_get_model_class, _GUARD_MARKER, True)
    auto_factory._get_model_class = _get_model_class


# ------------------------------------------------------------------------------------ export
def _template(name: str) -> str:
    return (resources.files("dspark_hf") / "hub_templates" / name).read_text(encoding="utf-8")


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
        target: the target model. Checked against the draft; needed when a copy of a borrowed
            embedding/LM head is written; its Qwen3 config is the base of a DeepSpec
            ``config.json``; its Hub id is the card's default ``base_model``.
        embeddings: write ``embed_tokens``/``lm_head``. ``None``: as the draft has them (``"hf"``),
            always (``"deepspec"``, which needs them).
        model_card: write ``README.md``; default True for ``"hf"``, False for ``"deepspec"``.
        base_model, repo_id, measured, training, license: passed to :func:`render_model_card`.
        max_shard_size: safetensors shard size (huggingface_hub's ``save_torch_state_dict``).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    if not isinstance(draft, DSparkDraftModel):
        raise TypeError(f"export needs a DSparkDraftModel, got {type(draft).__name__}.")
    if target is not None:
        draft.check_target(target)
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
            path.write_text(_template(template), encoding="utf-8")
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


# --------------------------------------------------------------------------- custom_generate
_CUSTOM_GENERATE_DRAFTS: dict[tuple, DSparkDraftModel] = {}
_LAST_CUSTOM_GENERATE_DRAFT: list[DSparkDraftModel] = []


def _unsanitize_module_name(name: str) -> str:
    """Inverse of transformers' ``_sanitize_module_name`` for Hub repo names."""
    if name.startswith("_") and name[1:2].isdigit():
        name = name[1:]
    return name.replace("_hyphen_", "-").replace("_dot_", ".")


def locate_custom_generate_source(generate_file: str | os.PathLike | None = None) -> tuple[str, str | None]:
    """Where the running ``custom_generate/generate.py`` came from: ``(repo id or folder, revision)``.

    transformers copies that file into its modules cache before running it, so ``__file__`` alone
    does not name the repository. In order:

    1. the ``custom_generate`` argument of the ``generate`` call that is running it (exact for Hub
       ids and local folders);
    2. ``generate_file`` itself when it sits in a draft folder (``<folder>/custom_generate/generate.py``
       next to ``config.json``), e.g. when imported directly;
    3. transformers' modules-cache path of a Hub repository,
       ``.../transformers_modules/<org>/<name>/<commit>/custom_generate/generate.py``.
    """
    frame = inspect.currentframe()
    try:
        depth = 0
        while frame is not None and depth < 16:
            if frame.f_code.co_name == "generate":
                value = frame.f_locals.get("custom_generate")
                if isinstance(value, (str, os.PathLike)):
                    return os.fspath(value), None
            frame = frame.f_back
            depth += 1
    finally:
        del frame
    if generate_file is not None:
        path = Path(os.path.abspath(generate_file))  # not resolve(): Hub snapshots are symlinks into blobs/
        if path.parent.name == "custom_generate" and (path.parent.parent / "config.json").is_file():
            return str(path.parent.parent), None
        parts = path.parts
        if "transformers_modules" in parts:
            rest = parts[parts.index("transformers_modules") + 1 :]
            if len(rest) == 5 and rest[3:] == ("custom_generate", "generate.py"):
                org, name, commit = rest[:3]
                return f"{_unsanitize_module_name(org)}/{_unsanitize_module_name(name)}", commit
    raise ValueError(
        "Could not tell which repository this custom_generate/generate.py belongs to. Pass the draft explicitly: "
        "target.generate(..., assistant_model=dspark_hf.DSparkDraftModel.from_pretrained(<draft repo>))."
    )


def _custom_generate_draft(source: str, revision: str | None, model: PreTrainedModel) -> DSparkDraftModel:
    weight = model.get_input_embeddings().weight
    key = (source, revision, str(weight.device), weight.dtype)
    draft = _CUSTOM_GENERATE_DRAFTS.get(key)
    if draft is None:
        kwargs = {"dtype": weight.dtype}
        if revision is not None:
            kwargs["revision"] = revision
        draft = DSparkDraftModel.from_pretrained(source, **kwargs).to(weight.device).eval()
        _CUSTOM_GENERATE_DRAFTS[key] = draft
    return draft


def run_custom_generate(model: PreTrainedModel, *args, _custom_generate_file=None, **kwargs):
    """The body of a draft repository's ``custom_generate/generate.py``: DSpark decoding with that draft.

    transformers calls it with the target as ``model`` and every ``generate`` argument. The draft is
    ``assistant_model`` when that is a DSpark draft, else the repository's own draft (located by
    :func:`locate_custom_generate_source`, loaded once per process, device and dtype). The call then
    runs the target's regular ``generate`` with that assistant, so all of DSpark's checks apply.
    """
    assistant = kwargs.pop("assistant_model", None)
    if assistant is not None:
        config = getattr(assistant, "config", None)
        if config is None or not is_dspark_config(config):
            raise ValueError(
                f"This custom_generate runs DSpark decoding, but assistant_model is a {type(assistant).__name__} "
                "without a DSpark config. Drop custom_generate to use another assistant, or pass a DSpark draft."
            )
        draft = assistant
    else:
        source, revision = locate_custom_generate_source(_custom_generate_file)
        draft = _custom_generate_draft(source, revision, model)
    _LAST_CUSTOM_GENERATE_DRAFT[:] = [draft]
    # the class's generate, not model.generate: a model loaded from a repo with its own
    # custom_generate has that attribute replaced
    return type(model).generate(model, *args, assistant_model=draft, **kwargs)


def last_custom_generate_draft() -> DSparkDraftModel | None:
    """The draft the latest ``custom_generate`` call used (its ``generation_stats`` hold that call's rounds)."""
    return _LAST_CUSTOM_GENERATE_DRAFT[0] if _LAST_CUSTOM_GENERATE_DRAFT else None


# ------------------------------------------------------------------------------- model cards
def _read_folder_facts(folder: Path) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """``config.json`` and the weight shapes (from the safetensors headers) of a draft folder."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return config, shapes


def _check_measured(measured: dict) -> None:
    if not isinstance(measured, dict) or not isinstance(measured.get("setup"), str) or not measured["setup"].strip():
        raise ValueError("measured needs a non-empty 'setup' string (hardware, dtype, temperature, prompts, lengths).")
    results = measured.get("results")
    if not isinstance(results, dict) or not results:
        raise ValueError("measured needs 'results': {method: {benchmark: tau}} with at least one method.")
    for method, row in results.items():
        if not isinstance(row, dict) or not row:
            raise ValueError(f"measured['results'][{method!r}] must be a non-empty {{benchmark: tau}} dict.")
        for bench, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(
                    f"measured['results'][{method!r}][{bench!r}] = {value!r} is not a measured number; "
                    "leave a benchmark out rather than filling it in."
                )


def _tau_table(measured: dict | None) -> str:
    if measured is None:
        return (
            "_Not measured yet._ This section is filled from benchmark runs "
            "(`render_model_card(folder, measured=...)`); numbers are never estimated."
        )
    _check_measured(measured)
    results = measured["results"]
    benchmarks = list(measured.get("benchmarks") or [])
    for row in results.values():
        benchmarks += [b for b in row if b not in benchmarks]
    lines = [
        "| method | " + " | ".join(benchmarks) + " |",
        "|---|" + "---:|" * len(benchmarks),
    ]
    for method, row in results.items():
        cells = [f"{row[b]:.2f}" if b in row else "–" for b in benchmarks]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + f"\n\nSetup: {measured['setup'].strip()}"
    if measured.get("source"):
        text += f"\n\nSource: {measured['source']}"
    return text


def _training_section(training: dict | None) -> str:
    if not training:
        return "_Training details for this draft are not recorded here._"
    return "\n".join(f"- **{key}**: {value}" for key, value in training.items())


def render_model_card(
    draft_folder: str | os.PathLike,
    measured: dict | None = None,
    *,
    base_model: str | None = None,
    repo_id: str | None = None,
    training: dict | None = None,
    license: str = "apache-2.0",
    template: str | os.PathLike | None = None,
) -> str:
    """A ``README.md`` model card for an exported draft folder (``"hf"`` or ``"deepspec"`` layout).

    Facts (layers, block size, heads, target layers, parameters, dtype) are read from the folder's
    ``config.json`` and safetensors headers. Hub metadata: ``license``, ``library_name:
    transformers``, ``base_model`` (when given), ``pipeline_tag: text-generation``, ``tags``.

    Args:
        measured: measured accepted lengths, or ``None`` for a "not measured yet" section. Shape:
            ``{"setup": "<hardware, dtype, temperature, prompts, lengths>", "results": {method:
            {benchmark: tau}}, "benchmarks": [column order] (optional), "source": "<where the numbers
            come from>" (optional)}``. Values must be real numbers; a missing benchmark is left out.
        base_model: the target's Hub id.
        repo_id: the draft's Hub id, used in the snippets (a placeholder when ``None``).
        training: facts of this draft's training run (rendered as a list), or ``None``.
        template: another card template (``string.Template`` syntax, same placeholders).
    """
    from huggingface_hub import ModelCardData

    folder = Path(draft_folder)
    config, shapes = _read_folder_facts(folder)
    fmt = checkpoint_format(config)
    if fmt not in ("dspark", "deepspec"):
        raise ValueError(f"{folder} is not a DSpark draft folder written by dspark_hf.hub.export (format {fmt}).")
    layout = "deepspec" if fmt == "deepspec" else "hf"
    markov_rank = int(config.get("markov_rank", 0))
    confidence = bool(config.get("enable_confidence_head", False))
    anchor_predicts = bool(config.get("anchor_predicts", True))
    method = "DSpark" if markov_rank > 0 or confidence else "DFlash"
    tags = list(CARD_TAGS) + (["custom_generate"] if layout == "hf" else ["deepspec"])
    metadata = ModelCardData(
        license=license,
        library_name="transformers",
        base_model=base_model,
        pipeline_tag="text-generation",
        tags=tags,
    ).to_yaml()
    block_size = int(config["block_size"])
    own_embeddings = "embed_tokens.weight" in shapes and "lm_head.weight" in shapes
    params = sum(math.prod(shape) for key, shape in shapes.items() if key != "draft_vocab_ids")  # ids: not weights
    facts = [
        ("Layout", "transformers (`model_type: dspark`, remote code)" if layout == "hf"
         else "DeepSpec (`model_type: qwen3`, `Qwen3DSparkModel`)"),
        ("Draft layers", config.get("num_hidden_layers")),
        ("Hidden size / vocabulary", f"{config.get('hidden_size')} / {config.get('vocab_size')}"),
        ("Draft tokens per round (`block_size`)", block_size),
        ("Drafted positions", "anchor + masks (DSpark)" if anchor_predicts else "mask positions (z-lab DFlash)"),
        ("Serial head", f"Markov, {config.get('markov_head_type')}, rank {markov_rank}" if markov_rank
         else "none (DFlash)"),
        ("Confidence head", ("yes" + (", calibrated" if config.get("confidence_temperatures") else ", uncalibrated"))
         if confidence else "no (the whole block is verified)"),
        ("Target layers read", f"{config.get('target_layer_ids')} of {config.get('num_target_layers')}"),
        ("Mask token id", config.get("mask_token_id")),
        ("Embedding / LM head", "stored (copies of the target's)" if own_embeddings else "borrowed from the target"),
        *([("Draft vocabulary", f"{config['draft_vocab_size']:,} of the {config.get('vocab_size'):,} target tokens "
            "(`draft_vocab_ids`); the others get draft probability 0 and still come from the target")]
          if config.get("draft_vocab_size") else []),
        ("Parameters stored", f"{params:,}"),
        ("Weights dtype", config.get("dtype") or config.get("torch_dtype")),
    ]
    if method == "DSpark":
        recipe = (
            "Method (DSpark paper, section 3.3): the target is frozen and the draft shares its embedding and LM "
            "head. Random anchors per sequence form blocks of `block_size` positions; the loss is 0.1 · cross-entropy "
            "+ 0.9 · total variation against the target's distribution + 1.0 · binary cross-entropy of the confidence "
            "head against `1 - ½‖p_draft − p_target‖₁`, each position weighted by `exp(−(k−1)/block_size)`. "
            "Confidences may then be calibrated by Sequential Temperature Scaling."
        )
    else:
        recipe = "This draft has no serial head and no confidence head; see the DFlash paper (arXiv:2602.06036) for its recipe."
    if method == "DSpark":
        description = (
            "DSpark adds to the DFlash parallel draft a light serial sampling loop (a low-rank Markov bias "
            "from the token just drawn) and a confidence head whose per-position acceptance estimates let a "
            "profiled scheduler verify only the prefix of the block that pays off on the running hardware."
        )
    else:
        description = "A DFlash parallel draft: one forward drafts the whole block, which the target verifies in full."
    shown_base = base_model or "<target-model-id>"
    values = {
        "metadata": metadata.strip(),
        "title": f"{repo_id.split('/')[-1] if repo_id else folder.name}: {method} draft"
        + (f" for {base_model}" if base_model else ""),
        "method": method,
        "method_description": description,
        "base_model": shown_base,
        "base_model_ref": f"[`{base_model}`](https://huggingface.co/{base_model})" if base_model
        else "its target model (not recorded in this card)",
        "repo_id": repo_id or "<org>/<this-draft-repo>",
        "block_size": block_size,
        "facts_table": "\n".join(f"| {k} | {v} |" for k, v in facts),
        "training": _training_section(training),
        "method_recipe": recipe,
        "tau_table": _tau_table(measured),
    }
    usage = string.Template(_template(f"card_usage_{layout}.md")).substitute(values)
    text = Path(template).read_text(encoding="utf-8") if template is not None else _template("model_card.md")
    return string.Template(text).substitute(values, usage=usage.strip())


__all__ = [
    "AUTO_MAP",
    "DEEPSPEC_FIELDS",
    "FORMATS",
    "checkpoint_format",
    "export",
    "last_custom_generate_draft",
    "locate_custom_generate_source",
    "push_to_hub",
    "register_auto_classes",
    "render_model_card",
    "run_custom_generate",
]
