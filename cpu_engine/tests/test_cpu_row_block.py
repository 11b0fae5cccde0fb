"""The row-block linear kernel: F.linear's numbers within rounding, rows independent of their batch, a
logged fallback to oneDNN where it cannot be built or run."""

import logging

import pytest
import torch
import torch.nn.functional as F

import dspark_cpu.extension as cpu_extension
import dspark_cpu.fast_path as fast_path
import dspark_cpu.packed_kernels as packed_kernels
import dspark_cpu.row_block as row_block
from dspark_cpu import optimize_for_cpu
from dspark_cpu.fast_path import PackedLinear
from tiny_models import random_target

_UNAVAILABLE = row_block.row_block_unavailable_reason()
needs_kernel = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"row-block kernel unavailable: {_UNAVAILABLE}")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
_CPU_ISA = None if _UNAVAILABLE else row_block._state["module"].cpu_isa()
_OFFERED = () if _CPU_ISA is None else row_block.ISAS[:row_block.ISAS.index(_CPU_ISA) + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features", [1, 8, 16, 40, 200])
@pytest.mark.parametrize("in_features", [72, 73])
def test_matches_f_linear_for_every_row_count(isa, dtype, out_features, in_features):
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator).div(8).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    packed = row_block.pack_row_blocks(weight)
    blocks = -(-out_features // 16)
    pairs = dtype == torch.bfloat16 and isa != "avx2"
    assert packed.dtype == dtype
    assert packed.shape == ((blocks, -(-in_features // 2), 32) if pairs else (blocks, in_features, 16))
    # every kernel width (one and two rows also span several blocks at once), full and partial groups
    for rows in list(range(1, 14)) + [24, 25, 31]:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        for b in (None, bias):
            got = row_block.row_block_linear(x, packed, out_features, b)
            expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
            assert got.dtype == dtype and got.shape == (rows, out_features)
            tolerance = TOLERANCE[dtype]
            assert torch.allclose(got.float(), expected, rtol=tolerance, atol=tolerance), (rows, (got.float() - expected).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_rows_result_does_not_depend_on_its_batch(isa, dtype):
    # Each output is one multiply-add chain in input order whatever the number of rows: bit for bit.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(120, 300, generator=generator).to(dtype)  # 8 blocks: tiles of 4 and 2 blocks, and single ones
    packed = row_block.pack_row_blocks(weight)
    x = torch.randn(16, 300, generator=generator).to(dtype)
    alone = torch.cat([row_block.row_block_linear(x[i:i + 1], packed, 120, None) for i in range(16)])
    for rows in (2, 3, 5, 6, 7, 8, 9, 12, 13, 16):
        assert torch.equal(row_block.row_block_linear(x[:rows], packed, 120, None), alone[:rows]), rows
    # F.linear does not promise this; the packed kernel in a verify forward then gives each token the
    # linear outputs of a one-token step.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fma_paths_give_the_avx2_bits(dtype):
    # AVX-512's FMA paths run each output's chain in the same order as AVX2's: the same bits. (bfloat16
    # inputs on an avx512_bf16 CPU go through VDPBF16PS instead: float32 inputs here keep the FMA path.)
    if "avx512" not in _OFFERED:
        pytest.skip(f"this CPU offers the row-block paths {_OFFERED or 'none'}, no AVX-512")
    module = row_block._state["module"]
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(100, 301, generator=generator).to(dtype)
    x = torch.randn(9, 301, generator=generator)
    results = {}
    before = module.isa()
    try:
        for isa in ("avx2", "avx512"):
            module.set_isa(isa)
            packed = row_block.pack_row_blocks(weight)
            # 3-8 rows of float32/float16 weights take two blocks at a time under AVX-512 (7 blocks: a single
            # one is left over), one under AVX2: each output's chain, and so its bits, stay the same.
            results[isa] = [row_block.row_block_linear(x[:rows], packed, 100, None) for rows in (1, 2, 3, 5, 8, 9)]
    finally:
        module.set_isa(before)
    assert all(torch.equal(a, b) for a, b in zip(results["avx2"], results["avx512"]))


@needs_kernel
def test_instruction_set_choices_are_checked(monkeypatch):
    module = row_block._state["module"]
    assert row_block.kernel_isa() == module.isa() in row_block.ISAS
    with pytest.raises(RuntimeError, match="unknown row-block instruction set 'sse9'"):
        module.set_isa("sse9")
    if _CPU_ISA != row_block.ISAS[-1]:
        wider = row_block.ISAS[row_block.ISAS.index(_CPU_ISA) + 1]
        with pytest.raises(RuntimeError, match=f"up to {_CPU_ISA}, not {wider}"):
            module.set_isa(wider)
    monkeypatch.setenv(row_block.ISA_ENV, "avx9000")
    assert "DSPARK_HF_ROW_BLOCK_ISA='avx9000' is not one of the paths this CPU offers" in row_block._pin_isa(module)
    monkeypatch.setenv(row_block.ISA_ENV, "avx2")
    before = module.isa()
    try:
        assert row_block._pin_isa(module) is None and module.isa() == "avx2"
    finally:
        module.set_isa(before)


@needs_kernel
def test_bfloat16_pairs_refuse_the_avx2_path():
    if "avx512" not in _OFFERED:
        pytest.skip("no AVX-512 here: bfloat16 is never packed in pairs")
    module = row_block._state["module"]
    packed = row_block._pack_for_isa(torch.randn(16, 8).to(torch.bfloat16), "avx512")
    before = module.isa()
    module.set_isa("avx2")
    try:
        with pytest.raises(RuntimeError, match="packed in bfloat16 pairs for AVX-512, which is not in use"):
            row_block.row_block_linear(torch.randn(1, 8).to(torch.bfloat16), packed, 16, None)
    finally:
        module.set_isa(before)


@needs_kernel
def test_batched_and_strided_inputs_keep_their_shape():
    weight = torch.randn(24, 32)
    packed = row_block.pack_row_blocks(weight)
    x = torch.randn(3, 32, 5).transpose(1, 2)  # [3, 5, 32], not contiguous
    got = row_block.row_block_linear(x, packed, 24, None)
    assert got.shape == (3, 5, 24) and torch.allclose(got, F.linear(x, weight), atol=1e-5)
    assert row_block.row_block_linear(torch.randn(0, 32), packed, 24, None).shape == (0, 24)


@needs_kernel
def test_a_prepared_bfloat16_model_keeps_no_float32_copy():
    model = optimize_for_cpu(random_target("llama", num_layers=2).to(torch.bfloat16), packed_min_rows=1,
                             packed_kernel="row_block")
    for module in model.modules():
        if isinstance(module, PackedLinear):
            packed = module._packed_weight()
            assert packed.dtype == torch.bfloat16
            padded_in = module.in_features + (module.in_features % 2 if packed.shape[-1] == 32 else 0)
            assert packed.numel() == -(-module.out_features // 16) * 16 * padded_in


@pytest.fixture
def unavailable_kernel(monkeypatch):
    monkeypatch.setattr(row_block, "_state", {"module": None, "problem": "no C++ compiler (test)"})


def test_without_the_kernel_oneDNN_is_used_and_asking_for_it_says_why(unavailable_kernel):
    model = optimize_for_cpu(random_target("llama", num_layers=1), packed_min_rows=1)
    kernels = {m._dspark_packed_kernel for m in model.modules() if isinstance(m, PackedLinear)}
    assert kernels == {"onednn"}
    with pytest.raises(ValueError, match=r"row_block.*no C\+\+ compiler \(test\).*'onednn'"):
        optimize_for_cpu(random_target("llama", num_layers=1), packed_kernel="row_block")
    assert packed_kernels.measure_packed_kernel(torch.randn(24, 8), ("onednn", "row_block"))[0] == "onednn"


@pytest.fixture
def fresh_extension(monkeypatch):
    """An extension not yet built, on a CPU and toolchain that pass the checks."""
    monkeypatch.setattr(row_block, "_state", {"module": None, "problem": None})
    monkeypatch.setattr(cpu_extension, "_state", {"module": None, "problem": None})
    monkeypatch.setattr(cpu_extension, "_cpu_problem", lambda: None)
    monkeypatch.setattr(cpu_extension, "cpp_toolchain_problem", lambda what: None)


def test_a_failed_build_is_remembered_and_logged(fresh_extension, monkeypatch, caplog):
    attempts = []

    def failing_build(verbose=False):
        attempts.append(1)
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(cpu_extension, "build_extension", failing_build)
    with caplog.at_level(logging.INFO, logger="dspark_cpu.row_block"):
        reason = row_block.row_block_unavailable_reason()
        assert row_block.row_block_unavailable_reason() == reason  # not rebuilt on every call
    assert attempts == [1]
    assert "building it failed (RuntimeError: compiler exploded)" in reason and "verbose=True" in reason
    assert "oneDNN's kernel runs instead" in caplog.text
    with pytest.raises(RuntimeError, match="compiler exploded"):
        row_block.load_kernel()


def test_a_kernel_that_disagrees_with_f_linear_is_not_used(fresh_extension, monkeypatch):
    class Wrong:
        @staticmethod
        def row_block_linear(x, packed, out_features, bias):
            return torch.zeros(*x.shape[:-1], out_features, dtype=x.dtype)

        cpu_isa = isa = staticmethod(lambda: "avx2")
        set_isa = staticmethod(lambda name: None)

    monkeypatch.setattr(cpu_extension, "build_extension", lambda verbose=False: Wrong())
    assert "different from F.linear" in row_block.row_block_unavailable_reason()
    assert not fast_path.row_block_usable(torch.float32)
    with pytest.raises(RuntimeError, match="different from F.linear"):  # a verbose rebuild is probed too
        row_block.load_kernel(verbose=True)


def test_machines_without_avx2_are_told_why(monkeypatch):
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "aarch64")
    assert "x86-64" in cpu_extension._cpu_problem()
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert "AVX2" in cpu_extension._cpu_problem()


@needs_kernel
def test_a_copy_made_where_the_kernel_cannot_run_falls_back_to_onednn(monkeypatch):
    import copy

    model = optimize_for_cpu(random_target("llama", num_layers=1), packed_min_rows=1, packed_kernel="row_block")
    ids = torch.randint(0, 48, (1, 6))
    with torch.no_grad():
        expected = model(ids).logits
    monkeypatch.setattr(row_block, "_state", {"module": None, "problem": "no C++ compiler (test)"})
    clone = copy.deepcopy(model)  # repacks on first use, as an unpickled model in another process does
    with torch.no_grad():
        assert torch.allclose(clone(ids).logits, expected, atol=1e-5)
    assert clone.model.layers[0].mlp.up_proj._dspark_packed_weight[5] is packed_kernels._run_packed
