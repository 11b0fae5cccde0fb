"""Where dspark_hf keeps files it builds for the user: step-rate profiles, the compiled CUDA op,
the SmolLM2 demo target and training features all live under one root."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir() -> Path:
    """``$DSPARK_HF_CACHE`` if set, else ``~/.cache/dspark_hf``."""
    env = os.environ.get("DSPARK_HF_CACHE")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/dspark_hf").expanduser()
