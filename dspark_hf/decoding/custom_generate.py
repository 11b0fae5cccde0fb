"""The body of a draft repository's ``custom_generate/generate.py``.

``target.generate(**inputs, custom_generate="<draft repo or folder>", trust_remote_code=True)``
makes transformers download that repository's ``custom_generate/generate.py`` (written by
:func:`dspark_hf.hub.export`) and call its ``generate(model, ...)``. That file only forwards to
:func:`run_custom_generate` here, which loads the repository's draft and runs DSpark decoding.

Finding the repository is the one awkward step: transformers copies ``generate.py`` into its
modules cache and calls it without the ``custom_generate`` argument, so the running file does not
know which repository it came from. :func:`locate_custom_generate_source` recovers it, first by
reading that argument from the calling ``generate`` frame (see
:func:`_custom_generate_argument_of_caller`), then from the file's own path.
"""

from __future__ import annotations

import inspect
import os
import threading
from pathlib import Path

from transformers import PreTrainedModel

from ..model.configuration_dspark import is_dspark_config
from ..model.modeling_dspark import DSparkDraftModel

# Drafts loaded for custom_generate calls, one per (source, revision, device, dtype): a repository's
# draft is read from disk once per process.
_DRAFTS: dict[tuple, DSparkDraftModel] = {}
_DRAFTS_LOCK = threading.Lock()
_LAST_DRAFT: list[DSparkDraftModel] = []
# How many frames up the stack to look for the ``generate`` call: transformers' ``generate`` calls
# the custom function directly (two or three frames above this module's code).
_MAX_FRAMES = 16


def _unsanitize_module_name(name: str) -> str:
    """Inverse of transformers' ``_sanitize_module_name`` for Hub repo names."""
    if name.startswith("_") and name[1:2].isdigit():
        name = name[1:]
    return name.replace("_hyphen_", "-").replace("_dot_", ".")


def _custom_generate_argument_of_caller() -> str | None:
    """The ``custom_generate`` argument of the ``generate`` call that is running us, or ``None``.

    transformers' ``GenerationMixin.generate`` receives ``custom_generate=<repo or folder>`` as a
    local variable and then calls the repository's function without it. Reading that local from
    the caller's frame is the only exact way to learn which repository (or local folder) the user
    named; transformers offers no hook for it. The walk is bounded and only reads a string.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(_MAX_FRAMES):
            if frame is None:
                return None
            if frame.f_code.co_name == "generate":
                value = frame.f_locals.get("custom_generate")
                if isinstance(value, (str, os.PathLike)):
                    return os.fspath(value)
            frame = frame.f_back
        return None
    finally:
        del frame  # frames reference their locals; do not keep the stack alive


def _source_of_generate_file(generate_file: str | os.PathLike) -> tuple[str, str | None] | None:
    """``(folder or repo id, revision)`` read from where ``custom_generate/generate.py`` lies, or ``None``."""
    path = Path(os.path.abspath(generate_file))  # not resolve(): Hub snapshots are symlinks into blobs/
    if path.parent.name == "custom_generate" and (path.parent.parent / "config.json").is_file():
        return str(path.parent.parent), None
    parts = path.parts
    if "transformers_modules" in parts:
        rest = parts[parts.index("transformers_modules") + 1 :]
        if len(rest) == 5 and rest[3:] == ("custom_generate", "generate.py"):
            org, name, commit = rest[:3]
            return f"{_unsanitize_module_name(org)}/{_unsanitize_module_name(name)}", commit
    return None


def locate_custom_generate_source(generate_file: str | os.PathLike | None = None) -> tuple[str, str | None]:
    """Where the running ``custom_generate/generate.py`` came from: ``(repo id or folder, revision)``.

    transformers copies that file into its modules cache before running it, so ``__file__`` alone
    does not name the repository. In order:

    1. the ``custom_generate`` argument of the ``generate`` call that is running it (exact for Hub
       ids and local folders; read from the calling frame, see :func:`_custom_generate_argument_of_caller`);
    2. ``generate_file`` itself when it sits in a draft folder (``<folder>/custom_generate/generate.py``
       next to ``config.json``), e.g. when imported directly;
    3. transformers' modules-cache path of a Hub repository,
       ``.../transformers_modules/<org>/<name>/<commit>/custom_generate/generate.py``.
    """
    named = _custom_generate_argument_of_caller()
    if named is not None:
        return named, None
    found = _source_of_generate_file(generate_file) if generate_file is not None else None
    if found is not None:
        return found
    raise ValueError(
        "Could not tell which repository this custom_generate/generate.py belongs to. Pass the draft explicitly: "
        "target.generate(..., assistant_model=dspark_hf.DSparkDraftModel.from_pretrained(<draft repo>))."
    )


def _load_draft(source: str, revision: str | None, model: PreTrainedModel) -> DSparkDraftModel:
    """The repository's draft on ``model``'s device and dtype, loaded once per process."""
    weight = model.get_input_embeddings().weight
    key = (source, revision, str(weight.device), weight.dtype)
    with _DRAFTS_LOCK:
        draft = _DRAFTS.get(key)
        if draft is None:
            kwargs = {"dtype": weight.dtype}
            if revision is not None:
                kwargs["revision"] = revision
            draft = DSparkDraftModel.from_pretrained(source, **kwargs).to(weight.device).eval()
            _DRAFTS[key] = draft
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
        draft = _load_draft(source, revision, model)
    _LAST_DRAFT[:] = [draft]
    # the class's generate, not model.generate: a model loaded from a repo with its own
    # custom_generate has that attribute replaced
    return type(model).generate(model, *args, assistant_model=draft, **kwargs)


def last_custom_generate_draft() -> DSparkDraftModel | None:
    """The draft the latest ``custom_generate`` call used (its ``last_generation_stats`` hold that call's rounds)."""
    return _LAST_DRAFT[0] if _LAST_DRAFT else None


__all__ = ["last_custom_generate_draft", "locate_custom_generate_source", "run_custom_generate"]
