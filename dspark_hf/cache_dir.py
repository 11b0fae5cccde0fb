"""Where dspark_hf keeps files it builds for the user: step-rate profiles, the compiled CUDA op and CPU kernel,
the SmolLM2 demo target and training features all live under one root."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

__all__ = ["default_cache_dir", "extension_dir"]


def default_cache_dir() -> Path:
    """``$DSPARK_HF_CACHE`` if set, else ``~/.cache/dspark_hf``."""
    env = os.environ.get("DSPARK_HF_CACHE")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/dspark_hf").expanduser()


def extension_dir() -> Path:
    """Where compiled extensions are cached, one folder per torch / CUDA / Python version:
    ``$DSPARK_HF_EXTENSION_DIR`` if set, else ``<default_cache_dir()>/torch_extensions``."""
    explicit = os.environ.get("DSPARK_HF_EXTENSION_DIR")
    root = Path(explicit) if explicit else default_cache_dir() / "torch_extensions"
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-py{sys.version_info[0]}{sys.version_info[1]}"
    return root.expanduser() / re.sub(r"[^A-Za-z0-9_.-]", "_", tag)
