"""The few-query attention kernel: SDPA's numbers within rounding, each query token's output that of
its own one-token step bit for bit, and SDPA wherever a call is not one it takes."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import dspark_cpu.attention as cpu_attention
from dspark_cpu import optimize_for_cpu
from dspark_cpu.attention import few_query_attention
from tiny_models import random_target

_UNAVAILABLE = cpu_attention.few_query_unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"few-query kernel unavailable: {_UNAVAILABLE}")
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _inputs(batch, heads, kv_heads, tokens, keys, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, tokens, heads, dim, generator=generator).transpose(1, 2)  # transformers' strides
    key, value = (torch.randn(batch, kv_heads, keys, dim, generator=generator) for _ in range(2))
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _causal_mask(batch, tokens, keys, padding=()):
    mask = torch.ones(tokens, keys, dtype=torch.bool).tril(diagonal=keys - tokens)[None, None].repeat(batch, 1, 1, 1)
    for row, width in enumerate(padding):
        mask[row, :, :, :width] = False
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (6, 2, 40)])
@pytest.mark.parametrize("tokens", [1, 3, 8, 16])
def test_matches_sdpa(dtype, heads, kv_heads, dim, tokens):
    query, key, value = _inputs(2, heads, kv_heads, tokens, 37, dim, dtype)
    mask = _causal_mask(2, tokens, 37, padding=(0, 5))  # the second row left-padded
    got = few_query_attention(query, key, value, mask, None)
    expected = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                              enable_gqa=True).transpose(1, 2)
    assert got is not None and got.dtype == dtype and got.shape == (2, tokens, heads, dim)
    assert torch.allclose(got.float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype]), \
        (got.float() - expected).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_token_gets_its_one_token_steps_output_bit_for_bit(dtype):
    tokens, keys = 8, 70
    query, key, value = _inputs(1, 9, 3, tokens, keys, 64, dtype, seed=3)
    together = few_query_attention(query, key, value, _causal_mask(1, tokens, keys), 0.125)
    for i in range(tokens):
        seen = keys - tokens + i + 1
        alone = few_query_attention(query[:, :, i:i + 1], key[:, :, :seen], value[:, :, :seen], None, 0.125)
        assert torch.equal(together[:, i:i + 1], alone), i
    # SDPA's CPU kernel does not promise this (and it is what makes verify forwards batch-invariant).


def test_a_fully_masked_token_gets_zeros():
    query, key, value = _inputs(1, 4, 2, 2, 6, 8, torch.float32)
    mask = torch.zeros(1, 1, 2, 6, dtype=torch.bool)
    mask[0, 0, 1, :3] = True
    got = few_query_attention(query, key, value, mask, None)
    assert torch.equal(got[:, 0], torch.zeros_like(got[:, 0]))
    expected = F.scaled_dot_product_attention(query[:, :, 1:], key[:, :, :3], value[:, :, :3], enable_gqa=True)
    assert torch.allclose(got[:, 1], expected.transpose(1, 2)[:, 0], atol=1e-6)


def test_calls_it_does_not_take_are_left_to_sdpa():
    query, key, value = _inputs(1, 4, 2, 3, 10, 16, torch.float32)
    mask = _causal_mask(1, 3, 10)
    assert few_query_attention(query, key, value, None, None) is None  # several tokens need a mask
    assert few_query_attention(query, key, value, mask, None) is not None  # (the call it does take)
    assert few_query_attention(query, key, value, mask, None, 0.1) is None  # dropout
    assert few_query_attention(query, key, value, mask, None, softcap=30.0) is None
    assert few_query_attention(query, key, value, mask.float(), None) is None  # an additive mask
    assert few_query_attention(query, key, value, mask[..., :9], None) is None  # not over exactly these keys
    assert few_query_attention(query.double(), key.double(), value.double(), mask, None) is None
    many = torch.randn(1, 4, cpu_attention.FEW_QUERY_MAX_TOKENS + 1, 16)
    wide_mask = _causal_mask(1, many.shape[2], 20)
    assert few_query_attention(many, torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16), wide_mask, None) is None
    odd = torch.randn(1, 4, 1, 12)
    assert few_query_attention(odd, torch.randn(1, 2, 5, 12), torch.randn(1, 2, 5, 12), None, None) is None
    one = torch.randn(1, 4, 1, 16)
    strided_key = torch.randn(1, 2, 16, 5).transpose(2, 3)  # head dim not contiguous
    assert few_query_attention(one, strided_key, torch.randn(1, 2, 5, 16), None, None) is None


def test_a_failing_probe_leaves_sdpa_with_a_logged_reason(monkeypatch, caplog):
    class Wrong:
        @staticmethod
        def few_query_attention(query, key, value, mask, scale):
            return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype)

    monkeypatch.setattr(cpu_attention, "_few_query_state", {"module": None, "problem": None})
    monkeypatch.setattr(cpu_attention.extension, "load_extension", lambda verbose=False: Wrong())
    monkeypatch.setattr(cpu_attention.extension, "extension_problem", lambda: None)
    with caplog.at_level("INFO"):
        assert "different from SDPA" in cpu_attention.few_query_unavailable_reason()
    assert "SDPA runs instead" in caplog.text
    query, key, value = _inputs(1, 4, 2, 1, 6, 8, torch.float32)
    assert few_query_attention(query, key, value, None, None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepared_model_takes_its_cached_steps_through_the_kernel(dtype, monkeypatch):
    stock = random_target("llama", num_layers=2).to(dtype)
    prepared = optimize_for_cpu(copy.deepcopy(stock))
    calls = []
    original = cpu_attention._few_query_state["module"].few_query_attention

    class Counting:
        @staticmethod
        def few_query_attention(*args):
            calls.append(args[0].shape[2])
            return original(*args)

    monkeypatch.setitem(cpu_attention._few_query_state, "module", Counting())
    context = torch.randint(1, 48, (1, 12), generator=torch.Generator().manual_seed(0))
    new_tokens = torch.randint(1, 48, (1, 5), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (stock, prepared):
        cache = DynamicCache()
        with torch.no_grad():
            model(context, cache=cache, use_cache=True)
            results.append(model(new_tokens, cache=cache, use_cache=True).logits.float())
    assert calls == [5, 5]  # both layers' 5-token verify step; the 12-token prefill stays on SDPA
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(results[1], results[0], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_thread_count_does_not_change_the_numbers(dtype):
    # Threads change how the queries of a key/value head are blocked (and whether a bfloat16 head is
    # widened once for several blocks or on the fly); no query's arithmetic may change with it.
    query, key, value = _inputs(2, 12, 3, 5, 41, 32, dtype, seed=4)
    mask = _causal_mask(2, 5, 41, padding=(0, 7))
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3, 4):  # blocks of 3 queries, and of 2 with 4 threads
            torch.set_num_threads(count)
            outputs.append(few_query_attention(query, key, value, mask, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def test_a_nan_key_makes_its_row_nan_as_in_sdpa():
    query, key, value = _inputs(1, 4, 2, 2, 9, 8, torch.float32)
    key[0, 1, 3, 0] = float("nan")  # seen by both tokens of the query heads 2 and 3
    got = few_query_attention(query, key, value, _causal_mask(1, 2, 9), None)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=_causal_mask(1, 2, 9),
                                              enable_gqa=True).transpose(1, 2)
    assert torch.isnan(expected[:, :, 2:]).all() and not torch.isnan(expected[:, :, :2]).any()
    assert torch.isnan(got[:, :, 2:]).all() and not torch.isnan(got[:, :, :2]).any()
