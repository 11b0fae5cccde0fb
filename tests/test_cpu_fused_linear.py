"""Sibling projections in one row-block call: the same bits as separate calls, no extra memory, and
out of the way as soon as a member's weight or bias changes."""

import copy

import pytest
import torch
from torch import nn
from transformers import DynamicCache

import dspark_hf.kernels.cpu_fused_linear as cpu_fused_linear
from dspark_hf import optimize_for_cpu
from dspark_hf.kernels import cpu_decoder, cpu_row_block
from dspark_hf.kernels.cpu_fast_path import pack_linear
from dspark_hf.kernels.cpu_fused_linear import fuse_projections
from tiny_models import random_target

pytestmark = pytest.mark.skipif(cpu_row_block.row_block_unavailable_reason() is not None,
                                reason=f"row-block kernel unavailable: {cpu_row_block.row_block_unavailable_reason()}")


@pytest.fixture
def fused_calls(monkeypatch):
    """How many groups ran as one call (and how many stepped aside)."""
    calls = {"fused": 0, "aside": 0}
    original = cpu_fused_linear.FusedProjections.__call__

    def counting(self, x):
        result = original(self, x)
        calls["fused" if result is not None else "aside"] += 1
        return result

    monkeypatch.setattr(cpu_fused_linear.FusedProjections, "__call__", counting)
    return calls


def _prepared(arch: str, dtype: torch.dtype = torch.float32, hidden_size: int = 64):
    stock = random_target(arch, num_layers=2, hidden_size=hidden_size).to(dtype)
    model = optimize_for_cpu(copy.deepcopy(stock), packed_min_rows=1, packed_kernel="row_block")
    return stock, model


def _outputs(model, ids, own_forward=False):
    """A prefill and two cached steps through the lean forward (or the decoder's own forward)."""
    forward = type(model.model).forward.__get__(model.model) if own_forward else model.model
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        return [forward(input_ids=ids[:, a:b], cache=cache, use_cache=True).last_hidden_state
                for a, b in ((0, 9), (9, 10), (10, 14))]


def _plan(model):
    return model.model.__dict__[cpu_decoder._INSTALLED_ATTRIBUTE]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_projections_give_the_separate_calls_bits(arch, dtype, fused_calls):
    stock, model = _prepared(arch, dtype)
    plan = _plan(model)
    assert all(plan.fused_qkv) and all(plan.fused_gate_up)
    ids = torch.randint(0, 48, (1, 14))
    expected = _outputs(model, ids, own_forward=True)  # separate PackedLinear calls
    fused_calls.update(fused=0, aside=0)
    got = _outputs(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert fused_calls == {"fused": 3 * 2 * 2, "aside": 0}  # 3 forwards x 2 layers x (q/k/v, gate/up)


def test_members_view_one_buffer_and_step_aside_when_a_weight_or_bias_changes(fused_calls):
    stock, model = _prepared("qwen2")  # q/k/v with biases
    group = _plan(model).fused_qkv[0]
    attention = model.model.layers[0].self_attn
    storage = group.packed.untyped_storage().data_ptr()
    assert all(m._packed_weight().untyped_storage().data_ptr() == storage
               for m in (attention.q_proj, attention.k_proj, attention.v_proj))
    ids = torch.randint(0, 48, (1, 14))
    with torch.no_grad():
        attention.k_proj.weight.mul_(1.5)
    got = _outputs(model, ids)
    assert fused_calls["aside"] == 3  # layer 0's q/k/v in each forward; its layer repacked its own weight
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model, ids, own_forward=True), got))
    group = _plan(model).fused_qkv[1]
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.bias.add_(0.25)
    assert group(torch.randn(1, 3, 64)) is None


def test_groups_are_refused_where_they_cannot_share_a_call():
    def packed(out_features, bias=False, kernel="row_block"):
        module = nn.Linear(32, out_features, bias=bias)
        pack_linear(module, 1, kernel)
        return module

    assert fuse_projections([packed(32), packed(16)]) is not None
    assert fuse_projections([packed(24), packed(16)]) is None  # a padded block before the last member
    assert fuse_projections([packed(16), packed(24)]) is not None  # padding at the end is fine
    assert fuse_projections([packed(16, bias=True), packed(16)]) is None  # bias on one member only
    assert fuse_projections([packed(16), nn.Linear(32, 16)]) is None  # not packed
    assert fuse_projections([packed(16), packed(16, kernel="onednn")]) is None  # another kernel
    assert fuse_projections([packed(16)]) is None


def test_a_copied_model_keeps_the_bits_without_its_groups(fused_calls):
    _, model = _prepared("llama")
    ids = torch.randint(0, 48, (1, 14))
    expected = _outputs(model, ids)
    clone = copy.deepcopy(model)
    fused_calls.update(fused=0, aside=0)
    assert all(torch.equal(a, b) for a, b in zip(expected, _outputs(clone, ids)))
    assert fused_calls == {"fused": 0, "aside": 12}
