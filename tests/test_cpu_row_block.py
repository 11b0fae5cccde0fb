"""The row-block linear kernel: F.linear's numbers within rounding, rows independent of their batch, a
logged fallback to oneDNN where it cannot be built or run."""

import logging

import pytest
import torch
import torch.nn.functional as F

import dspark_hf.kernels.cpu_fast_path as fast_path
import dspark_hf.kernels.cpu_row_block as row_block
from dspark_hf import optimize_for_cpu
from dspark_hf.kernels.cpu_fast_path import PackedLinear
from tiny_models import random_target

_UNAVAILABLE = row_block.row_block_unavailable_reason()
needs_kernel = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"row-block kernel unavailable: {_UNAVAILABLE}")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features", [1, 8, 16, 40, 200])
def test_matches_f_linear_for_every_row_count(dtype, out_features):
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 72, generator=generator).div(8).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    packed = row_block.pack_row_blocks(weight)
    assert packed.dtype == dtype and packed.shape == (-(-out_features // 16), 72, 16)
    for rows in list(range(1, 14)) + [24, 25, 31]:  # every kernel width, full and partial groups of 12
        x = torch.randn(rows, 72, generator=generator).to(dtype)
        for b in (None, bias):
            got = row_block.row_block_linear(x, packed, out_features, b)
            expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
            assert got.dtype == dtype and got.shape == (rows, out_features)
            tolerance = TOLERANCE[dtype]
            assert torch.allclose(got.float(), expected, rtol=tolerance, atol=tolerance), (rows, (got.float() - expected).abs().max())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_its_batch(dtype):
    # Each output is one multiply-add chain in input order whatever the number of rows: bit for bit.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(56, 300, generator=generator).to(dtype)
    packed = row_block.pack_row_blocks(weight)
    x = torch.randn(16, 300, generator=generator).to(dtype)
    alone = torch.cat([row_block.row_block_linear(x[i:i + 1], packed, 56, None) for i in range(16)])
    for rows in (2, 5, 6, 7, 12, 13, 16):
        assert torch.equal(row_block.row_block_linear(x[:rows], packed, 56, None), alone[:rows]), rows
    # F.linear does not promise this; the packed kernel in a verify forward then gives each token the
    # linear outputs of a one-token step.


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
            assert packed.numel() == -(-module.out_features // 16) * 16 * module.in_features


@pytest.fixture
def unavailable_kernel(monkeypatch):
    monkeypatch.setattr(row_block, "_state", {"module": None, "problem": "no C++ compiler (test)"})


def test_without_the_kernel_oneDNN_is_used_and_asking_for_it_says_why(unavailable_kernel):
    model = optimize_for_cpu(random_target("llama", num_layers=1), packed_min_rows=1)
    kernels = {m._dspark_packed_kernel for m in model.modules() if isinstance(m, PackedLinear)}
    assert kernels == {"onednn"}
    with pytest.raises(ValueError, match=r"row_block.*no C\+\+ compiler \(test\).*'onednn'"):
        optimize_for_cpu(random_target("llama", num_layers=1), packed_kernel="row_block")
    assert fast_path.measure_packed_kernel(torch.randn(24, 8), ("onednn", "row_block"))[0] == "onednn"


def test_a_failed_build_is_remembered_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(row_block, "_state", {"module": None, "problem": None})
    monkeypatch.setattr(row_block, "_cpu_problem", lambda: None)
    monkeypatch.setattr(row_block, "cpp_toolchain_problem", lambda what: None)
    attempts = []

    def failing_build(verbose=False):
        attempts.append(1)
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(row_block, "_build", failing_build)
    with caplog.at_level(logging.INFO, logger="dspark_hf.kernels.cpu_row_block"):
        reason = row_block.row_block_unavailable_reason()
        assert row_block.row_block_unavailable_reason() == reason  # not rebuilt on every call
    assert attempts == [1]
    assert "building it failed (RuntimeError: compiler exploded)" in reason and "verbose=True" in reason
    assert "oneDNN's kernel runs instead" in caplog.text
    with pytest.raises(RuntimeError, match="compiler exploded"):
        row_block.load_kernel()


def test_a_kernel_that_disagrees_with_f_linear_is_not_used(monkeypatch):
    class Wrong:
        @staticmethod
        def row_block_linear(x, packed, out_features, bias):
            return torch.zeros(*x.shape[:-1], out_features, dtype=x.dtype)

    monkeypatch.setattr(row_block, "_state", {"module": None, "problem": None})
    monkeypatch.setattr(row_block, "_cpu_problem", lambda: None)
    monkeypatch.setattr(row_block, "cpp_toolchain_problem", lambda what: None)
    monkeypatch.setattr(row_block, "_build", lambda verbose=False: Wrong())
    assert "different from F.linear" in row_block.row_block_unavailable_reason()
    assert not fast_path.row_block_usable(torch.float32)
    with pytest.raises(RuntimeError, match="different from F.linear"):  # a verbose rebuild is probed too
        row_block.load_kernel(verbose=True)


def test_machines_without_avx2_are_told_why(monkeypatch):
    monkeypatch.setattr(row_block.platform, "machine", lambda: "aarch64")
    assert "x86-64" in row_block._cpu_problem()
    monkeypatch.setattr(row_block.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert "AVX2" in row_block._cpu_problem()


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
    assert clone.model.layers[0].mlp.up_proj._dspark_packed_weight[5] is fast_path._run_packed


def test_a_missing_toolchain_is_named(monkeypatch):
    from torch.utils import cpp_extension

    from dspark_hf.kernels.build_tools import cpp_toolchain_problem

    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert "no C++ compiler: 'no-such-compiler-xyz'" in cpp_toolchain_problem("the kernel")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    assert "ninja is not installed (pip install ninja)" in cpp_toolchain_problem("the kernel")
    assert "to build the kernel" in cpp_toolchain_problem("the kernel")
