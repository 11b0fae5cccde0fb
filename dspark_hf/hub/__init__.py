"""Hub tooling: writing drafts in a loadable layout, uploading them, and their model cards.

* :mod:`dspark_hf.hub.draft_export`: :func:`export` (Hub-ready transformers folder or DeepSpec
  folder) and :func:`push_to_hub`;
* :mod:`dspark_hf.hub.vllm_export`: ``export(..., format="vllm")`` and :func:`vllm_compatibility`
  (why vLLM 0.34.0 cannot serve a draft, or ``None``);
* :mod:`dspark_hf.hub.model_card`: :func:`render_model_card`;
* ``dspark_hf/hub/templates/``: the remote-code, ``custom_generate`` and model-card templates.

The run-time side of the Hub lives with the decoding path: auto-class registration in
:mod:`dspark_hf.model.auto_classes`, layout detection in :mod:`dspark_hf.model.checkpoint_formats` and the
``custom_generate`` entry point in :mod:`dspark_hf.custom_generate`. They are re-exported here
because drafts already on the Hub run ``from dspark_hf.hub import run_custom_generate``.
"""

from ..model.auto_classes import register_auto_classes
from ..model.checkpoint_formats import checkpoint_format
from ..decoding.custom_generate import last_custom_generate_draft, locate_custom_generate_source, run_custom_generate
from ..model.modeling_dspark import register_hub_upload
from .draft_export import AUTO_MAP, DEEPSPEC_FIELDS, FORMATS, export, push_to_hub
from .model_card import render_model_card
from .vllm_export import vllm_compatibility

register_hub_upload(push_to_hub)  # draft.push_to_hub(...) uploads through the exporter; the model never imports it

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
    "vllm_compatibility",
]
