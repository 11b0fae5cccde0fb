"""Which draft layout a ``config.json`` describes.

Three layouts load into :class:`~dspark_hf.DSparkDraftModel` (docs/formats.md describes each):

* ``"dspark"``: this library's transformers layout (``model_type: "dspark"``), as
  :func:`dspark_hf.hub.export` writes it.
* ``"deepspec"``: DeepSpec's released layout (``model_type: "qwen3"``, ``architectures:
  ["Qwen3DSparkModel"]``); DFlash drafts in it have ``markov_rank: 0``.
* ``"zlab-dflash"``: z-lab DFlash drafts (``architectures: ["DFlashDraftModel"]``).
* ``"speculators"``: DSpark and DFlash drafts trained with vllm-project/speculators (no
  ``model_type``; ``speculators_model_type`` and ``transformer_layer_config`` instead), translated by
  :mod:`dspark_hf.model.speculators_format`. Checked first: speculators names its classes like ours.

Kept apart from the auto-class registration (:mod:`dspark_hf.model.auto_classes`) and from the Hub
export so that both, and the model-card renderer, can ask the question without importing the model.
"""

from __future__ import annotations

from typing import Any

from .configuration_dspark import DSPARK_ARCHITECTURE_SUFFIXES, is_zlab_dflash_config_dict
from .speculators_format import SPECULATORS_MARKERS, is_speculators_config_dict

CHECKPOINT_FORMATS = ("dspark", "deepspec", "zlab-dflash", "speculators")


def checkpoint_format(config: dict | Any) -> str | None:
    """``"dspark"``, ``"deepspec"``, ``"zlab-dflash"``, ``"speculators"`` or ``None`` for a config
    object or ``config.json`` dict."""
    if not isinstance(config, dict):
        config = {key: getattr(config, key) for key in ("model_type", "architectures", *SPECULATORS_MARKERS)
                  if hasattr(config, key)}
    if is_speculators_config_dict(config):
        return "speculators"
    if config.get("model_type") == "dspark":
        return "dspark"
    if is_zlab_dflash_config_dict(config):
        return "zlab-dflash"
    if any(str(a).endswith(DSPARK_ARCHITECTURE_SUFFIXES) for a in config.get("architectures") or []):
        return "deepspec"
    return None


__all__ = ["CHECKPOINT_FORMATS", "checkpoint_format"]
