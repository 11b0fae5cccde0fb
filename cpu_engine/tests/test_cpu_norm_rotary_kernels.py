"""The lean decoder's compiled norm and rotation: PyTorch's own results bit for bit, and the norm used
only with the summation width that reproduces this torch build."""

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import dspark_cpu.decoder as cpu_decoder
import dspark_cpu.extension as cpu_extension
from tiny_models import random_target

_PROBLEM = cpu_extension.extension_problem()
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=f"CPU extension unavailable: {_PROBLEM}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _kernels():
    return cpu_extension.load_extension()


def _norm(size, dtype, seed=0):
    norm = LlamaRMSNorm(size, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return norm.to(dtype)


def _lanes():
    lanes = cpu_decoder.rms_norm_kernel_lanes(random_target("llama", num_layers=1))
    assert lanes in (8, 16), "no summation width reproduces this torch build's norm"
    return lanes


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_transformers_bit_for_bit(dtype):
    # Sizes below one vector, single vectors, leftovers past the last vector, and rows long enough for
    # the cascade's partial sums (more than 16 groups of four vectors).
    lanes = _lanes()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for size in (5, 8, 15, 64, 100, 576, 1536, 4100, 11008):
            norm = _norm(size, dtype, seed=size)
            for rows in (1, 3, 8, 16):
                x = (torch.randn(2, rows, size, generator=generator) * 3).to(dtype)
                assert torch.equal(_kernels().rms_norm(x, norm.weight, norm.variance_epsilon, lanes), norm(x)), \
                    (size, rows)


def test_the_summation_width_matters():
    # The calibration can tell the widths apart: on rows of 64 the two orders round differently somewhere.
    generator = torch.Generator().manual_seed(2)
    norm = _norm(64, torch.float32)
    x = torch.randn(64, 64, generator=generator) * 3
    with torch.no_grad():
        by_width = [_kernels().rms_norm(x, norm.weight, 1e-5, lanes) for lanes in (8, 16)]
        assert not torch.equal(*by_width)
        assert sum(torch.equal(out, norm(x)) for out in by_width) == 1


def test_a_norm_the_kernel_does_not_reproduce_keeps_its_own_forward(monkeypatch):
    model = random_target("llama", num_layers=1)
    original = LlamaRMSNorm.forward
    monkeypatch.setattr(LlamaRMSNorm, "forward", lambda self, x: original(self, x) * 1.001)
    assert cpu_decoder.rms_norm_kernel_lanes(model) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("batch,rotary_batch", [(1, 1), (2, 1), (2, 2)])
def test_rotary_kernel_equals_the_rolled_rotation_bit_for_bit(dtype, tokens, batch, rotary_batch):
    generator = torch.Generator().manual_seed(tokens)
    query = torch.randn(batch, tokens, 6, 32, generator=generator).to(dtype).transpose(1, 2)  # transformers' strides
    key = torch.randn(batch, tokens, 2, 32, generator=generator).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(rotary_batch, tokens, 32, generator=generator).to(dtype) for _ in range(2))
    signed_sin = torch.cat([-sin[..., :16], sin[..., 16:]], dim=-1)
    c, s = cos.unsqueeze(1), signed_sin.unsqueeze(1)
    expected = (query * c + query.roll(16, -1) * s, key * c + key.roll(16, -1) * s)
    got = _kernels().rotary_embedding(query, key, cos, signed_sin)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_rotary_kernel_refuses_what_it_cannot_rotate():
    query, key = torch.randn(1, 2, 1, 24), torch.randn(1, 1, 1, 24)  # head dim not a multiple of 16
    cos = torch.randn(1, 1, 24)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _kernels().rotary_embedding(query, key, cos, cos)
    # ... and the lean decoder does not send it such calls: the rotation falls back to PyTorch's ops.
    model = random_target("llama", num_layers=1)
    plan = cpu_decoder._LeanPlan(model.model)
    assert plan.rotary_kernel
    kernel = cpu_decoder._rotary_kernel(plan, cos, cos)  # what the lean forward passes for these tables
    assert kernel is None
    out_query, out_key = cpu_decoder._rotate(plan, query, key, cos, cos, cos, kernel)
    assert torch.equal(out_query, query * cos.unsqueeze(1) + query.roll(12, -1) * cos.unsqueeze(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_forward_rotates_through_the_kernel_with_the_stock_bits(dtype, monkeypatch):
    # Head dim 16: the kernel takes the rotation (the other tests' tiny models have head dim 8, which it refuses).
    stock = random_target("llama", hidden_size=64, num_layers=2).to(dtype)
    lean = copy.deepcopy(stock)
    assert cpu_decoder.use_lean_decoder(lean)
    used = []
    original = cpu_decoder._rotary_kernel
    monkeypatch.setattr(cpu_decoder, "_rotary_kernel", lambda *a: used.append(original(*a)) or used[-1])
    ids = torch.randint(1, 48, (1, 11), generator=torch.Generator().manual_seed(5))
    outputs = []
    for model in (stock, lean):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            outputs.append([model(ids[:, :8], cache=cache).logits, model(ids[:, 8:], cache=cache).logits])
    assert used and all(kernel is not None for kernel in used)
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
