"""The text templates of the Hub tooling, shipped as package data in ``dspark_hf/hub/templates/``.

Remote-code files and ``custom_generate/generate.py`` that :func:`dspark_hf.hub.export` copies
into a draft folder, and the model-card templates :func:`dspark_hf.hub.render_model_card` fills.
"""

from __future__ import annotations

from importlib import resources

TEMPLATE_PACKAGE = "dspark_hf.hub"
TEMPLATE_FOLDER = "templates"


def read_template(name: str) -> str:
    """The text of ``dspark_hf/hub/templates/<name>`` (works from a wheel as from a source tree)."""
    return (resources.files(TEMPLATE_PACKAGE) / TEMPLATE_FOLDER / name).read_text(encoding="utf-8")


__all__ = ["read_template"]
