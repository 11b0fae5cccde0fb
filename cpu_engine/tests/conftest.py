"""Fixtures of the CPU engine's tests (the shared ones, cache and threads, are in the repository's conftest.py;
tiny_models and the other helpers in tests/)."""

import pytest


@pytest.fixture(params=("avx2", "avx512", "avx512_bf16"))
def isa(request):
    """Each instruction-set path of the CPU row-block kernel in turn (those this CPU lacks, or all where the
    kernel cannot run, are skipped), restored afterwards."""
    import dspark_cpu.row_block as row_block

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
