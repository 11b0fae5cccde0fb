"""Fixtures of the core's tests (the shared ones, cache and threads, are in the repository's conftest.py)."""

import pytest
import torch


@pytest.fixture
def isolated_training(tmp_path, monkeypatch):
    """Caches under tmp_path, and the torch thread count the test found (``--threads`` sets it process-wide):
    for tests that run ``dspark-hf train``."""
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
