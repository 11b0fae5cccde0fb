"""optimize_for_cpu's lean decoder forward: the same outputs, bit for bit, and the stock forward
wherever the lean one was not built for the call."""

import copy
import logging
import pickle

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

import dspark_cpu.decoder as cpu_decoder
import dspark_cpu.extension as cpu_extension
from dspark_cpu import optimize_for_cpu
from dspark_cpu.decoder import remove_lean_decoder, use_lean_decoder, uses_lean_decoder
from generation_helpers import left_pad
from tiny_models import random_target

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture
def lean_layer_calls(monkeypatch):
    """How many decoder layers the lean loop ran (its attention step is called once per layer)."""
    calls = []
    original = cpu_decoder._attention
    monkeypatch.setattr(cpu_decoder, "_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def _steps(model, ids, splits, **kwargs):
    """Base-model outputs of a prefill and cached steps over ``ids`` cut at ``splits``."""
    cache = DynamicCache(config=model.config)
    outputs = []
    with torch.no_grad():
        for start, end in zip((0, *splits), (*splits, ids.shape[1])):
            outputs.append(model.model(input_ids=ids[:, start:end], cache=cache, use_cache=True, **kwargs))
    return outputs


def _assert_same_outputs(expected, got):
    assert len(expected) == len(got)
    for want, have in zip(expected, got):
        assert torch.equal(want.last_hidden_state, have.last_hidden_state)
        want_hidden, have_hidden = want.get("hidden_states"), have.get("hidden_states")
        assert (want_hidden is None) == (have_hidden is None)
        if want_hidden is not None:
            assert len(want_hidden) == len(have_hidden)
            for a, b in zip(want_hidden, have_hidden):
                assert (a is None) == (b is None)
                assert a is None or torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_lean_forward_equals_the_stock_forward_bit_for_bit(arch, dtype, lean_layer_calls):
    stock = random_target(arch, num_layers=3)
    with torch.no_grad():  # norm weights other than 1, as in a trained model (with 1 more shortcuts agree)
        for module in stock.modules():
            if "RMSNorm" in type(module).__name__:
                module.weight.normal_(1.0, 0.5, generator=torch.Generator().manual_seed(len(module.weight)))
    stock = stock.to(dtype)
    lean = copy.deepcopy(stock)
    assert use_lean_decoder(lean)
    assert uses_lean_decoder(lean) and not uses_lean_decoder(stock)
    plan = lean.model.__dict__[cpu_decoder._INSTALLED_ATTRIBUTE]
    assert plan.roll_rotary  # the shortcuts are part of what is compared
    assert plan.fused_norm == (dtype == torch.float32)  # torch's bf16 rms_norm rounds after the weight
    if cpu_extension.extension_problem() is None:  # and so are the compiled norm and rotation
        assert plan.rotary_kernel and plan.norm_kernel_lanes in (8, 16)
    ids = torch.randint(1, 48, (2, 14), generator=torch.Generator().manual_seed(1))
    for kwargs in ({}, {"output_hidden_states": True}, {"output_hidden_states": [0, 2, -1]},
                   {"output_hidden_states": [1]}):
        lean_layer_calls.clear()
        expected = _steps(stock, ids, (8, 9, 12), **kwargs)
        assert not lean_layer_calls
        got = _steps(lean, ids, (8, 9, 12), **kwargs)
        assert len(lean_layer_calls) == 4 * 3  # four forwards of three layers: every one took the lean loop
        _assert_same_outputs(expected, got)


def test_left_padded_batches_and_generate_equal_the_stock_model(lean_layer_calls):
    stock = random_target("llama", num_layers=3)
    lean = copy.deepcopy(stock)
    assert use_lean_decoder(lean)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12, 13]], pad_token_id=0)
    with torch.no_grad():
        expected = stock(input_ids=ids, attention_mask=mask).logits
        got = lean(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(expected[mask.bool()], got[mask.bool()])
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = stock.generate(ids, attention_mask=mask, **settings)
    lean_layer_calls.clear()
    got = lean.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(expected, got)
    assert len(lean_layer_calls) >= 12 * 3


def test_a_draft_assisted_generate_through_the_lean_target_equals_the_target_alone(lean_layer_calls):
    from tiny_models import markov_draft

    target = random_target("llama", num_layers=3, context_scale=0.3)
    table = torch.randint(0, 48, (48,), generator=torch.Generator().manual_seed(3))
    draft = markov_draft(target, torch.nn.functional.one_hot(table, 48).float() * 8)
    prompt = torch.tensor([[3, 9, 27, 4]])
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    optimize_for_cpu(target)
    assert uses_lean_decoder(target)
    lean_layer_calls.clear()
    got = target.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False)
    assert torch.equal(expected, got)
    assert lean_layer_calls  # the verify forwards (which ask for hidden states) ran the lean loop


def test_calls_it_was_not_built_for_take_the_stock_forward(lean_layer_calls):
    stock = random_target("llama", num_layers=2)
    lean = copy.deepcopy(stock)
    assert use_lean_decoder(lean)
    ids = torch.tensor([[1, 2, 3, 4]])
    lean_layer_calls.clear()
    with torch.no_grad():
        assert lean(ids, output_attentions=True).attentions == stock(ids, output_attentions=True).attentions
        with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
            lean.model(input_ids=ids, inputs_embeds=lean.model.embed_tokens(ids))
    with torch.enable_grad():  # gradients: the stock forward (and its autograd graph)
        loss = lean(ids, labels=ids).loss
        loss.backward()
        assert lean.model.layers[0].mlp.up_proj.weight.grad is not None
    assert not lean_layer_calls
    with torch.no_grad():
        lean.model(inputs_embeds=lean.model.embed_tokens(ids))
    assert lean_layer_calls  # inputs_embeds alone is fine


def test_a_hook_on_a_bypassed_module_runs_because_the_stock_forward_does(lean_layer_calls):
    stock = random_target("llama", num_layers=2)
    lean = copy.deepcopy(stock)
    assert use_lean_decoder(lean)
    for model in (stock, lean):
        model.model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, output: output * 0)
    ids = torch.tensor([[1, 2, 3, 4]])
    lean_layer_calls.clear()
    with torch.no_grad():
        expected, got = stock(ids).logits, lean(ids).logits
    assert torch.equal(expected, got)
    assert not lean_layer_calls
    pre = lean.model.layers[0].input_layernorm.register_forward_pre_hook(lambda module, args: None)
    with torch.no_grad():
        lean(ids)
    assert not lean_layer_calls
    pre.remove()


def test_unsupported_decoders_keep_their_forward_and_say_why(caplog):
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40))
    sliding = random_target("mistral-sliding", num_layers=2)
    with caplog.at_level(logging.INFO, logger="dspark_cpu.decoder"):
        assert not use_lean_decoder(gpt2)
        assert not use_lean_decoder(sliding)
    assert "has no embed_tokens" in caplog.text or "GPT2" in caplog.text
    assert "sliding-window attention (sliding_window=6)" in caplog.text
    assert "forward" not in sliding.model.__dict__ and not uses_lean_decoder(sliding)


def test_a_probe_difference_refuses_the_lean_forward(monkeypatch, caplog):
    model = random_target("llama", num_layers=2)
    original = cpu_decoder._mlp
    monkeypatch.setattr(cpu_decoder, "_mlp", lambda layer, x: original(layer, x) * (1 + 1e-6))
    with caplog.at_level(logging.INFO, logger="dspark_cpu.decoder"):
        assert not use_lean_decoder(model)
    assert "a probe gave outputs different from its own forward" in caplog.text
    assert "forward" not in model.model.__dict__ and not uses_lean_decoder(model)
    model.train()  # probed in eval mode all the same (in training mode both forwards would be the stock one)
    assert not use_lean_decoder(model) and model.training


def test_a_shortcut_that_differs_falls_back_to_the_models_own_functions(monkeypatch):
    stock = random_target("llama", num_layers=2)
    model = copy.deepcopy(stock)
    with monkeypatch.context() as patch:  # a norm that is not the model's: caught by the per-norm check
        patch.setattr(cpu_decoder.F, "rms_norm", lambda x, shape, weight, eps: torch.nn.functional.layer_norm(
            x, shape, weight, eps=eps))
        assert use_lean_decoder(model)
        plan = model.model.__dict__[cpu_decoder._INSTALLED_ATTRIBUTE]
        assert not plan.fused_norm and plan.roll_rotary
    remove_lean_decoder(model)
    original = cpu_decoder._rotate

    def skewed(plan, query, key, cos, sin, signed_sin, kernel):  # a rolled rotation that is off: caught by the probe
        query, key = original(plan, query, key, cos, sin, signed_sin, kernel)
        return (query * (1 + 1e-3), key) if signed_sin is not None else (query, key)

    monkeypatch.setattr(cpu_decoder, "_rotate", skewed)
    assert use_lean_decoder(model)
    plan = model.model.__dict__[cpu_decoder._INSTALLED_ATTRIBUTE]
    assert not plan.fused_norm and not plan.roll_rotary
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock(ids).logits)


def test_removal_copies_and_pickles(tmp_path):
    stock = random_target("qwen3", num_layers=2)
    lean = copy.deepcopy(stock)
    assert use_lean_decoder(lean) and use_lean_decoder(lean)  # idempotent
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = stock(ids).logits
        for model in (copy.deepcopy(lean), pickle.loads(pickle.dumps(lean))):
            assert uses_lean_decoder(model)
            assert torch.equal(model(ids).logits, expected)
    remove_lean_decoder(lean)
    assert not uses_lean_decoder(lean) and "forward" not in lean.model.__dict__
    lean.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", "generation_config.json",
                                                                "model.safetensors"])


def test_batched_dspark_through_the_lean_target_equals_each_prompt_alone(lean_layer_calls):
    from dspark_hf import FixedLengthPolicy
    from tiny_models import markov_draft, target_next_token_table

    stock = random_target("llama", eos_token_id=5, context_scale=0.5)
    lean = copy.deepcopy(stock)
    assert use_lean_decoder(lean)
    draft = markov_draft(lean, target_next_token_table(lean), block_size=4,
                         confidence_logits=torch.linspace(-2, 4, 48))
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(4)
    prompts = [[7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21]]
    ids, mask = left_pad(prompts, 0)
    lean_layer_calls.clear()
    out = lean.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                        assistant_model=draft)
    assert lean_layer_calls  # the batched verify forwards (padded rows, hidden states) ran the lean loop
    for i, prompt in enumerate(prompts):
        alone = stock.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)
        alone = alone[0, len(prompt):].tolist()
        row = out[i, ids.shape[1]:].tolist()
        assert row[: len(alone)] == alone and all(t == 0 for t in row[len(alone):]), f"row {i}"
