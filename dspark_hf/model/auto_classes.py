"""transformers' auto classes and DSpark drafts: registration and the DeepSpec-layout guard.

``import dspark_hf`` calls :func:`register_auto_classes`, after which ``AutoConfig`` /
``AutoModel.from_pretrained`` build a :class:`~dspark_hf.DSparkDraftModel` from a ``"dspark"``
checkpoint or a vllm-project/speculators DSpark/DFlash one (which has no ``model_type``). A DeepSpec-layout draft says ``model_type: "qwen3"``: without the guard an auto class
would silently build a plain Qwen3 model from it and drop the DSpark heads, so every auto class
refuses it with the advice to use ``DSparkDraftModel.from_pretrained``.
"""

from __future__ import annotations

import functools

from transformers import AutoConfig, AutoModel
from transformers.utils import logging

from .configuration_dspark import DSparkConfig, is_dspark_config
from .modeling_dspark import DSparkDraftModel

logger = logging.get_logger(__name__)

# Set on our wrapper so that a second registration sees it and does not wrap twice.
_GUARD_MARKER = "_dspark_auto_guard"


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
    _read_speculators_configs()
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


def _read_speculators_configs() -> None:
    """Lets ``AutoConfig`` (and so ``AutoModel``) read vllm-project/speculators DSpark/DFlash drafts.

    Their ``config.json`` has no ``model_type``, so transformers stops with "Should have a
    `model_type` key". The wrapper steps in only then: when transformers raised and the file is a
    speculators one, it returns :class:`DSparkConfig` (which translates it, or raises naming what is
    not supported); every config transformers reads itself is untouched.
    """
    original = AutoConfig.from_pretrained.__func__
    if getattr(original, _GUARD_MARKER, False):
        return

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        try:
            return original(cls, pretrained_model_name_or_path, **kwargs)
        except ValueError:
            from transformers import PreTrainedConfig

            from .speculators_format import is_speculators_config_dict

            try:
                config_dict, _ = PreTrainedConfig.get_config_dict(pretrained_model_name_or_path, **dict(kwargs))
            except (OSError, ValueError):
                config_dict = {}
            if not is_speculators_config_dict(config_dict):
                raise
            for key in ("trust_remote_code", "code_revision", "_from_auto"):
                kwargs.pop(key, None)
            return DSparkConfig.from_pretrained(pretrained_model_name_or_path, **kwargs)

    setattr(from_pretrained, _GUARD_MARKER, True)
    AutoConfig.from_pretrained = classmethod(from_pretrained)


__all__ = ["register_auto_classes"]
