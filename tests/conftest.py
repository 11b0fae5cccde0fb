"""Shared fixtures: an isolated dspark_hf cache, fixed thread count, no network."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Compiled kernels (the CPU row-block kernel, built on first use, ~30 s) go to the checkout's pytest
# cache, not the user's ~/.cache, and are reused by later runs; set at import so collection sees it too.
os.environ.setdefault("DSPARK_HF_EXTENSION_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "dspark_hf_extensions"))

import pytest
import torch

# Tiny models run far faster on one thread than with the 2-core pool (thread hand-off dominates).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path_factory.getbasetemp() / "dspark_cache"))
    torch.manual_seed(0)
    yield


@pytest.fixture
def isolated_training(tmp_path, monkeypatch):
    """Caches under tmp_path, and the torch thread count the test found (``--threads`` sets it process-wide):
    for tests that run ``dspark-hf train``."""
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=("avx2", "avx512", "avx512_bf16"))
def isa(request):
    """Each instruction-set path of the CPU row-block kernel in turn (those this CPU lacks, or all where the
    kernel cannot run, are skipped), restored afterwards."""
    import dspark_hf.kernels.cpu_row_block as row_block

    problem = row_block.row_block_unavailable_reason()
    if problem is not None:
        pytest.skip(f"row-block kernel unavailable: {problem}")
    module = row_block._state["module"]
    offered = row_block.ISAS[:row_block.ISAS.index(module.cpu_isa()) + 1]
    if request.param not in offered:
        pytest.skip(f"this CPU offers the row-block paths {offered}, not {request.param}")
    before = module.isa()
    module.set_isa(request.param)
    yield request.param
    module.set_isa(before)
