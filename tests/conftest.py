"""Shared fixtures: an isolated dspark_hf cache, fixed thread count, no network."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

# Tiny models run far faster on one thread than with the 2-core pool (thread hand-off dominates).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path_factory.getbasetemp() / "dspark_cache"))
    torch.manual_seed(0)
    yield
