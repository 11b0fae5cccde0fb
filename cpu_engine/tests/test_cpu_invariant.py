"""optimize_for_cpu(batch_invariant=True): a verify of k tokens gives each the logits of a one-token step,
bit for bit; greedy DSpark then equals the target alone; clear errors where it cannot hold."""

import copy

import pytest
import torch

import dspark_cpu.attention as cpu_attention
import dspark_cpu.invariant as invariant
import dspark_cpu.row_block as row_block
from dspark_cpu import optimize_for_cpu
from dspark_hf import FixedLengthPolicy
from dspark_cpu.fast_path import PackedLinear
from tiny_models import markov_draft, random_target, target_next_token_table

_UNAVAILABLE = row_block.row_block_unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"row-block kernel unavailable: {_UNAVAILABLE}")


def _verify_and_steps(model, ids, attention_mask, prefill):
    """Logits of ids[:, prefill:] from one forward on a cache, and from one-token steps on a copy of it."""
    with torch.no_grad():
        cache = model(input_ids=ids[:, :prefill], attention_mask=attention_mask[:, :prefill], use_cache=True).past_key_values
        stepped = copy.deepcopy(cache)
        together = model(input_ids=ids[:, prefill:], attention_mask=attention_mask, cache=cache).logits
        alone = torch.cat([model(input_ids=ids[:, i:i + 1], attention_mask=attention_mask[:, :i + 1],
                                 cache=stepped).logits for i in range(prefill, ids.shape[1])], dim=1)
    return together, alone


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_verify_gives_each_token_the_logits_of_a_one_token_step(arch, monkeypatch):
    ids = torch.randint(0, 48, (1, 17))
    mask = torch.ones_like(ids)
    with monkeypatch.context() as without_kernel:
        # power check: with SDPA's attention (no few-query kernel) the two round differently in float32
        without_kernel.setattr(cpu_attention, "_few_query_state", {"module": None, "problem": "not built (test)"})
        plain = optimize_for_cpu(random_target(arch, num_layers=2), packed_min_rows=1, packed_kernel="row_block")
        together, alone = _verify_and_steps(plain, ids, mask, prefill=11)
        assert not torch.equal(together, alone) and torch.allclose(together, alone, atol=1e-5)
    model = optimize_for_cpu(random_target(arch, num_layers=2), batch_invariant=True)
    assert invariant.uses_batch_invariant_verify(model)
    together, alone = _verify_and_steps(model, ids, mask, prefill=11)
    assert torch.equal(together, alone)
    bf16 = optimize_for_cpu(random_target(arch, num_layers=2).to(torch.bfloat16), batch_invariant=True)
    together, alone = _verify_and_steps(bf16, ids, mask, prefill=11)
    assert torch.equal(together, alone)


def test_left_padded_rows_keep_their_padding_mask():
    model = optimize_for_cpu(random_target("llama", num_layers=2), batch_invariant=True)
    ids = torch.randint(3, 48, (2, 15))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # the second row is left-padded
    together, alone = _verify_and_steps(model, ids, mask, prefill=10)
    assert torch.equal(together, alone)
    # and the padding is honoured: the padded row's logits ignore what stands in its padding
    changed = ids.clone()
    changed[1, :4] = 7
    again, _ = _verify_and_steps(model, changed, mask, prefill=10)
    assert torch.allclose(again[1], together[1], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_dspark_equals_the_prepared_target_alone(dtype):
    target = optimize_for_cpu(random_target("llama", num_layers=3).to(dtype), batch_invariant=True)
    draft = markov_draft(target, target_next_token_table(target), block_size=4).to(dtype)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(4)
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        prompt = torch.randint(3, 48, (1, int(torch.randint(4, 12, (1,), generator=generator))), generator=generator)
        expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
        got = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=draft)
        assert got.tolist() == expected.tolist()
    assert draft.last_generation_stats.accepted_tokens > 0


def test_every_linear_runs_the_row_block_kernel_from_one_row_even_if_packed_before():
    model = optimize_for_cpu(random_target("llama", num_layers=2), packed_min_rows=3, packed_kernel="onednn")
    optimize_for_cpu(model, batch_invariant=True)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and all((m._dspark_packed_kernel, m._dspark_packed_min_rows) == ("row_block", 1) for m in layers)
    assert all(m._packed_weight().dim() == 3 for m in layers)  # re-packed in 16-column blocks


def test_options_that_contradict_it_are_refused():
    with pytest.raises(ValueError, match="packed_kernel='onednn'"):
        optimize_for_cpu(random_target("llama", num_layers=1), batch_invariant=True, packed_kernel="onednn")
    with pytest.raises(ValueError, match="packed_min_rows=4"):
        optimize_for_cpu(random_target("llama", num_layers=1), batch_invariant=True, packed_min_rows=4)
    eager = random_target("llama", num_layers=1)
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="'eager'.*attn_implementation='sdpa'"):
        optimize_for_cpu(eager, batch_invariant=True)


def test_without_the_row_block_kernel_it_says_why(monkeypatch):
    monkeypatch.setattr(row_block, "_state", {"module": None, "problem": "no C++ compiler (test)"})
    with pytest.raises(ValueError, match=r"row-block linear kernel.*no C\+\+ compiler \(test\)"):
        optimize_for_cpu(random_target("llama", num_layers=1), batch_invariant=True)


def test_a_model_that_fails_the_probe_is_refused_and_keeps_its_attention(monkeypatch):
    monkeypatch.setattr(invariant, "_probe_difference", lambda model: "max logit difference 0.5")
    model = random_target("llama", num_layers=1)
    with pytest.raises(ValueError, match="4-token verify.*max logit difference 0.5.*without batch_invariant"):
        optimize_for_cpu(model, batch_invariant=True)
    assert model.config._attn_implementation == "sdpa_cpu_gqa"
    assert not invariant.uses_batch_invariant_verify(model)
