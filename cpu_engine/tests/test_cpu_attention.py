"""optimize_for_cpu's attention part: grouped-query SDPA without repeat_kv copies on CPU."""

import copy
import json

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import dspark_cpu.attention as cpu_attention
from dspark_cpu import optimize_for_cpu
from dspark_hf import DSparkDraftModel
from dspark_cpu.attention import CPU_GQA_ATTENTION, use_cpu_gqa_attention
from tiny_models import random_target


def _cached_step_logits(model, context, new_tokens):
    """Logits of a multi-token step on a cached context: the verify forward's shape."""
    cache = DynamicCache()
    with torch.no_grad():
        model(context, cache=cache, use_cache=True)
        return model(new_tokens, cache=cache, use_cache=True).logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_multi_token_steps_equal_the_stock_model_and_skip_repeat_kv(arch, monkeypatch):
    stock = random_target(arch, num_layers=3)
    prepared = copy.deepcopy(stock)
    assert use_cpu_gqa_attention(prepared)
    assert prepared.config._attn_implementation == CPU_GQA_ATTENTION
    delegated = []
    original = cpu_attention.sdpa_attention_forward
    monkeypatch.setattr(cpu_attention, "sdpa_attention_forward",
                        lambda *a, **k: delegated.append(a[1].shape[2]) or original(*a, **k))
    context = torch.randint(1, 48, (2, 9), generator=torch.Generator().manual_seed(0))
    new_tokens = torch.randint(1, 48, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = _cached_step_logits(stock, context, new_tokens)
    delegated.clear()
    got = _cached_step_logits(prepared, context, new_tokens)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    # The prefill (9 tokens, causal, no mask needed) may go to transformers' function; the masked
    # 5-token step must not: that is the case this module exists for.
    assert 5 not in delegated, "the multi-token cached step still went through repeat_kv"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_token_half_precision_steps_regroup_the_query_and_equal_the_stock_model(dtype, monkeypatch):
    # Without the few-query kernel (which would take these steps): SDPA with the query regrouped.
    monkeypatch.setattr(cpu_attention, "_few_query_state", {"module": None, "problem": "not built (test)"})
    stock = random_target("llama", num_layers=2).to(dtype)
    prepared = copy.deepcopy(stock)
    assert use_cpu_gqa_attention(prepared) and stock.config.num_key_value_heads < stock.config.num_attention_heads
    regrouped = []
    original = cpu_attention._one_token_regrouped
    monkeypatch.setattr(cpu_attention, "_one_token_regrouped", lambda *a: regrouped.append(a[0].shape) or original(*a))
    context = torch.randint(1, 48, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row: the one-token step carries a padding mask
    for attention_mask in (None, mask):
        regrouped.clear()
        caches = []
        for model in (stock, prepared):
            cache = DynamicCache()
            with torch.no_grad():
                model(context, cache=cache, attention_mask=None if attention_mask is None else attention_mask[:, :9])
                caches.append(model(context[:, -1:], cache=cache, attention_mask=attention_mask).logits.float())
        assert torch.allclose(caches[1], caches[0], rtol=1e-3, atol=1e-3), (caches[1] - caches[0]).abs().max()
        # float32 keeps SDPA's grouped broadcast (it measured faster there); half precision regroups.
        assert len(regrouped) == (0 if dtype == torch.float32 else 2)


def test_greedy_generation_is_unchanged():
    stock = random_target(num_layers=3)
    prepared = optimize_for_cpu(copy.deepcopy(stock), packed_min_rows=1)
    assert prepared.config._attn_implementation == CPU_GQA_ATTENTION
    prompt = torch.randint(1, 48, (1, 7), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(prepared.generate(prompt, **kwargs), stock.generate(prompt, **kwargs))


def test_idempotent_reversible_and_not_saved(tmp_path):
    model = random_target(num_layers=2)
    optimize_for_cpu(model)
    optimize_for_cpu(model)
    assert model.config._attn_implementation == CPU_GQA_ATTENTION
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert CPU_GQA_ATTENTION not in json.dumps(saved), "the run-time attention choice must not be saved"
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_models_it_does_not_handle_are_left_alone(caplog):
    eager = random_target(num_layers=2)
    eager.set_attn_implementation("eager")
    assert not use_cpu_gqa_attention(eager) and eager.config._attn_implementation == "eager"
    draft = DSparkDraftModel.from_target(random_target(num_layers=2), block_size=4)
    before = getattr(draft.config, "_attn_implementation", None)
    assert not use_cpu_gqa_attention(draft)  # its own attention already calls SDPA with enable_gqa
    assert getattr(draft.config, "_attn_implementation", None) == before


def test_a_failing_probe_keeps_sdpa_with_a_logged_reason(monkeypatch, caplog):
    model = random_target(num_layers=2)
    monkeypatch.setattr(cpu_attention, "cpu_gqa_unavailable_reason", lambda: "probe says no")
    with caplog.at_level("WARNING"):
        assert not use_cpu_gqa_attention(model)
    assert model.config._attn_implementation == "sdpa"
    assert "probe says no" in caplog.text


def test_batched_dspark_with_a_prepared_target_equals_the_stock_target_per_row():
    """Left-padded rows and ragged verify lengths give masked multi-token steps: the case the
    attention function handles itself."""
    from dspark_hf import FixedLengthPolicy
    from tiny_models import markov_draft, target_next_token_table

    stock = random_target(context_scale=0.5, eos_token_id=5)
    target = optimize_for_cpu(copy.deepcopy(stock))
    assert target.config._attn_implementation == CPU_GQA_ATTENTION
    draft = markov_draft(target, target_next_token_table(target), block_size=4)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(4)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(6, 48, (n,), generator=generator).tolist() for n in (3, 9, 6)]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    out = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                          assistant_model=draft)
    for i, prompt in enumerate(prompts):
        alone = stock.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)
        expected = alone[0, len(prompt):].tolist()
        assert out[i, width:width + len(expected)].tolist() == expected, f"row {i}"
    assert draft.last_generation_stats.accepted_tokens > 0


@pytest.mark.skipif(cpu_attention.few_query_unavailable_reason() is not None, reason="few-query kernel unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_without_grouped_heads_gets_the_few_query_kernel(dtype):
    # One key/value head per query head: nothing to regroup, but decode and verify steps still go to the
    # kernel, so each verified token gets its one-token step's bits as with grouped heads.
    stock = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4)).eval().to(dtype)
    # Every linear on the row-block kernel (a row's bits never depend on the other rows): a measured kernel
    # choice may take oneDNN for 4 rows and not for 1 on these tiny shapes, which would make the check flaky.
    prepared = optimize_for_cpu(copy.deepcopy(stock), packed_min_rows=1, packed_kernel="row_block")
    assert prepared.config._attn_implementation == CPU_GQA_ATTENTION
    ids = torch.randint(1, 48, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = stock(ids).logits
        cache = DynamicCache(config=prepared.config)
        prepared(ids[:, :8], cache=cache)
        together = prepared(ids[:, 8:], cache=cache).logits
        cache.crop(-4)
        alone = torch.cat([prepared(ids[:, i:i + 1], cache=cache).logits for i in range(8, 12)], dim=1)
    assert torch.equal(together, alone)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(together.float(), expected[:, 8:].float(), atol=tolerance, rtol=tolerance)
