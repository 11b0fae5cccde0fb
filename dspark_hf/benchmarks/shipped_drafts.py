"""Where the shipped SmolLM2 drafts are, for the benchmarks and the examples.

The drafts (``drafts/smollm2-135m-dspark`` and ``drafts/smollm2-135m-dflash``, about 20 MB each)
are part of the source repository, not of the installed package. They are looked up in order:

1. an explicit folder (``--drafts-dir`` of ``dspark-hf bench``);
2. ``$DSPARK_HF_DRAFTS``;
3. ``drafts/`` of the source tree this package was imported from, when it has one (a clone,
   installed editable or put on ``PYTHONPATH``);

and otherwise the command stops with a message naming where to get them.
"""

from __future__ import annotations

import os
from pathlib import Path

DRAFTS_ENV = "DSPARK_HF_DRAFTS"
DSPARK_DRAFT = "smollm2-135m-dspark"
DFLASH_DRAFT = "smollm2-135m-dflash"
# dspark_hf/benchmarks/ -> dspark_hf/ -> the source tree (which holds drafts/ in a clone)
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
SOURCE_TREE_DRAFTS = _PACKAGE_DIR.parent / "drafts"
WHERE_TO_GET_THEM = (
    f"The SmolLM2 drafts are not part of the installed package: they are the folders drafts/{DSPARK_DRAFT} and "
    f"drafts/{DFLASH_DRAFT} of the dspark_hf source repository (a git clone has them)"
)


def shipped_drafts_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The folder holding the shipped drafts: ``explicit``, else ``$DSPARK_HF_DRAFTS``, else the
    source tree's ``drafts/`` when it exists, else ``None``."""
    if explicit:
        return Path(explicit)
    from_env = os.environ.get(DRAFTS_ENV)
    if from_env:
        return Path(from_env)
    return SOURCE_TREE_DRAFTS if SOURCE_TREE_DRAFTS.is_dir() else None


def missing_draft_message(path: str | os.PathLike | None, how_to_pass: str) -> str | None:
    """Why a default shipped-draft folder cannot be used, or ``None`` when it holds a draft.

    ``path`` is ``None`` when no drafts folder was found at all. ``how_to_pass`` ends the message
    with the options that name another draft.
    """
    if path is None:
        return (f"no drafts folder found (no --drafts-dir, no ${DRAFTS_ENV}, and {SOURCE_TREE_DRAFTS} does not "
                f"exist). {WHERE_TO_GET_THEM}. {how_to_pass}")
    path = Path(path)
    if (path / "config.json").is_file():
        return None
    state = "has no config.json" if path.is_dir() else "does not exist"
    return f"the shipped draft folder {path} {state}. {WHERE_TO_GET_THEM}. {how_to_pass}"


__all__ = ["DFLASH_DRAFT", "DRAFTS_ENV", "DSPARK_DRAFT", "SOURCE_TREE_DRAFTS", "missing_draft_message",
           "shipped_drafts_dir"]
