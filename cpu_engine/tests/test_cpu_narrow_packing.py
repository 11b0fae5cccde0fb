"""Float32 weights that bfloat16 or float16 hold exactly are packed in 16 bits: the same results bit for bit."""

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import dspark_cpu.row_block as row_block
from dspark_cpu import optimize_for_cpu
from dspark_cpu.fast_path import PackedLinear
from tiny_models import random_target

_UNAVAILABLE = row_block.row_block_unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"row-block kernel unavailable: {_UNAVAILABLE}")


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


def _holding(dtype: torch.dtype, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight holding only ``dtype`` values, among them zeros of both signs and the dtype's tiny ones."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    weight[0, :4] = torch.tensor([0.0, -0.0, 6e-8, -1e-5])
    return weight.to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features", [16, 40, 200])
def test_a_16_bit_packing_gives_the_float32_packings_bits_for_every_row_count(isa, dtype, out_features):
    weight = _holding(dtype, out_features, 72)
    bias = torch.randn(out_features)
    wide, narrow = row_block.pack_row_blocks(weight), row_block.pack_row_blocks(weight.to(dtype))
    assert wide.dtype == torch.float32 and narrow.dtype == dtype
    generator = torch.Generator().manual_seed(1)
    for rows in list(range(1, 18)) + [24, 31, 64]:  # every kernel width, wide groups, full and partial row groups
        x = torch.randn(rows, 72, generator=generator)
        x[0, :2] = torch.tensor([-0.0, 1e-40])  # a negative zero and a subnormal input
        for b in (None, bias):
            expected = row_block.row_block_linear(x, wide, out_features, b)
            got = row_block.row_block_linear(x, narrow, out_features, b)
            assert got.dtype == torch.float32 and torch.equal(_bits(got), _bits(expected)), (rows, b is None)


def test_the_narrow_dtype_is_one_that_holds_every_value(isa):
    assert row_block.narrow_packing_matches(torch.bfloat16) and row_block.narrow_packing_matches(torch.float16)
    first, second = row_block._NARROW_ORDER[isa]
    both = torch.tensor([[0.5, -0.25, 3.0, 0.0]]).repeat(4, 1)  # values both dtypes hold: the path's first choice
    assert row_block.exact_narrow_dtype(both) == first
    bfloat16_only = (_holding(torch.bfloat16, 8, 6) * 1e-6).to(torch.bfloat16).float()  # below float16's range
    assert row_block.exact_narrow_dtype(bfloat16_only) == torch.bfloat16
    float16_only = _holding(torch.float16, 8, 6)  # float16's 10 fraction bits are more than bfloat16's 7
    float16_only[0, 0] = 1 + 2**-10
    assert row_block.exact_narrow_dtype(float16_only) == torch.float16
    off_by_one_ulp = both.clone()
    off_by_one_ulp[2, 1] = torch.nextafter(off_by_one_ulp[2, 1], torch.tensor(1.0))
    assert row_block.exact_narrow_dtype(off_by_one_ulp) is None
    assert row_block.exact_narrow_dtype(torch.randn(8, 6)) is None
    # bfloat16 pairs pad an odd width with a zero weight, which would turn an output of -0.0 into +0.0
    odd = (_holding(torch.bfloat16, 8, 7) * 1e-6).to(torch.bfloat16).float()
    assert row_block.exact_narrow_dtype(odd) is None
    assert row_block.exact_narrow_dtype(both.to(torch.bfloat16)) is None  # only float32 weights are narrowed
    assert row_block.exact_narrow_dtype(both[0]) is None


def _half_checkpoint_in_float32(tmp_path, dtype, arch="llama"):
    """A tiny model saved in ``dtype`` and loaded in float32, as from a half-precision checkpoint on the Hub."""
    random_target(arch, hidden_size=64, num_layers=2).to(dtype).save_pretrained(tmp_path / "half")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float32).eval()


def _row_block_layers(model):
    return [m for m in model.modules() if isinstance(m, PackedLinear) and m._dspark_packed_kernel == "row_block"]


def _logits_of_steps(model, ids):
    """Logits of a prefill and cached steps of 1, 3 and 8 tokens (a decode step and verify forwards)."""
    cache, logits, start = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for length in (ids.shape[1] - 12, 1, 3, 8):
            logits.append(model(input_ids=ids[:, start:start + length], cache=cache).logits)
            start += length
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_checkpoint_loaded_in_float32_runs_16_bit_copies_with_the_same_bits(
        tmp_path, dtype, arch, caplog):
    stock = _half_checkpoint_in_float32(tmp_path, dtype, arch)
    wide = optimize_for_cpu(copy.deepcopy(stock), packed_min_rows=1, packed_kernel="row_block", narrow_weights=False)
    narrow = copy.deepcopy(stock)
    with caplog.at_level(logging.INFO, logger="dspark_cpu.fast_path"):
        optimize_for_cpu(narrow, packed_min_rows=1, packed_kernel="row_block")
    assert {m._packed_weight().dtype for m in _row_block_layers(wide)} == {torch.float32}
    narrowed = {m._packed_weight().dtype for m in _row_block_layers(narrow)}
    assert narrowed <= {torch.bfloat16, torch.float16} and len(_row_block_layers(narrow)) > 0
    assert "hold only" in caplog.text and "bit for bit" in caplog.text
    assert sum(m._packed_weight().nbytes for m in _row_block_layers(narrow)) * 2 <= sum(
        m._packed_weight().nbytes for m in _row_block_layers(wide)) + 16 * 64 * 4 * len(_row_block_layers(wide))
    ids = torch.randint(0, 48, (2, 30), generator=torch.Generator().manual_seed(0))
    for expected, got in zip(_logits_of_steps(wide, ids), _logits_of_steps(narrow, ids)):
        assert torch.equal(_bits(got), _bits(expected))
    prompt = ids[:1, :9]
    assert (narrow.generate(prompt, max_new_tokens=20, do_sample=False).tolist()
            == stock.generate(prompt, max_new_tokens=20, do_sample=False).tolist())
    narrow.save_pretrained(tmp_path / "saved")  # the model's own float32 weights
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for name, tensor in stock.state_dict().items():
        assert tensor.dtype == reloaded.state_dict()[name].dtype and torch.equal(reloaded.state_dict()[name], tensor)


def test_a_weight_changed_after_narrow_packing_is_packed_again(tmp_path):
    model = optimize_for_cpu(_half_checkpoint_in_float32(tmp_path, torch.bfloat16), packed_min_rows=1,
                             packed_kernel="row_block")
    layer = model.model.layers[0].mlp.up_proj
    assert layer._packed_weight().dtype in (torch.bfloat16, torch.float16)
    x = torch.randn(5, layer.in_features)
    with torch.no_grad():
        layer.weight.mul_(1 + 2**-20)  # in place: values no 16-bit dtype holds
        got = layer(x)
        assert layer._packed_weight().dtype == torch.float32
        expected = row_block.row_block_linear(x, row_block.pack_row_blocks(layer.weight), layer.out_features, None)
        assert torch.equal(_bits(got), _bits(expected))


def test_narrow_weights_can_be_switched_on_a_prepared_model(tmp_path):
    model = optimize_for_cpu(_half_checkpoint_in_float32(tmp_path, torch.bfloat16), packed_min_rows=1,
                             packed_kernel="row_block", narrow_weights=False)
    assert {m._packed_weight().dtype for m in _row_block_layers(model)} == {torch.float32}
    optimize_for_cpu(model, packed_min_rows=1, packed_kernel="row_block")
    assert {m._packed_weight().dtype for m in _row_block_layers(model)} <= {torch.bfloat16, torch.float16}
    optimize_for_cpu(model, packed_min_rows=1, packed_kernel="row_block", narrow_weights=False)
    assert {m._packed_weight().dtype for m in _row_block_layers(model)} == {torch.float32}


class _DifferingNarrowKernel:
    """The extension module, except that a 16-bit packed weight gives results one bit off (a kernel whose
    16-bit path does not reproduce its float32 one)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def row_block_linear(self, x, packed, out_features, bias):
        out = self._module.row_block_linear(x, packed, out_features, bias)
        return torch.nextafter(out, torch.full_like(out, float("inf"))) if packed.dtype != torch.float32 else out


def test_a_16_bit_packing_that_fails_its_probe_is_not_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(row_block._state, "module", _DifferingNarrowKernel(row_block._state["module"]))
    monkeypatch.setattr(row_block, "_narrow_checks", {})
    with caplog.at_level(logging.INFO, logger="dspark_cpu.row_block"):
        model = optimize_for_cpu(_half_checkpoint_in_float32(tmp_path, torch.bfloat16), packed_min_rows=1,
                                 packed_kernel="row_block")
    assert {m._packed_weight().dtype for m in _row_block_layers(model)} == {torch.float32}
    assert "stay packed in float32" in caplog.text
