"""Shared by the core's tests (tests/) and the CPU engine's (cpu_engine/tests/): an isolated dspark_hf cache,
a fixed thread count, no network. Helpers such as tiny_models live in tests/ (on the path: pyproject's
``pythonpath``)."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Compiled kernels (the CPU row-block kernel, built on first use, ~30 s) go to the checkout's pytest
# cache, not the user's ~/.cache, and are reused by later runs; set at import so collection sees it too.
os.environ.setdefault("DSPARK_HF_EXTENSION_DIR", str(Path(__file__).resolve().parent / ".pytest_cache" / "dspark_hf_extensions"))

import pytest
import torch

# Tiny models run far faster on one thread than with the 2-core pool (thread hand-off dominates).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path_factory.getbasetemp() / "dspark_cache"))
    torch.manual_seed(0)
    yield
