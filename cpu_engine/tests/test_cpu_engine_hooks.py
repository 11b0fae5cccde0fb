"""How the CPU engine plugs into the DSpark core (dspark_hf.engine_hooks, dspark_hf.cpu_engine): the packing
hook packs a reduced draft head's gathered rows like the packed full head, the fingerprint keys a prepared
model's step-rate profile apart (and by the kernels' code), and dspark_hf.optimize_for_cpu is the engine's."""

import pytest
import torch

import dspark_cpu
import dspark_cpu.kernel_choices as kernel_choices
import dspark_hf
from dspark_cpu import PackedLinear, fast_path_unavailable_reason, is_optimized_for_cpu, optimize_for_cpu
from dspark_hf import engine_hooks
from dspark_hf.cpu_engine import engine_available, load_engine, prepare_for_cpu
from dspark_hf.model.draft_vocab import gathered_head
from dspark_hf.scheduling.step_rates import sps_cache_key
from test_draft_vocab import _reduced_draft, _target
from tiny_models import random_target

pytestmark = pytest.mark.skipif(fast_path_unavailable_reason() is not None,
                                reason=f"oneDNN packed linears unavailable: {fast_path_unavailable_reason()}")


def test_the_engine_answers_at_its_old_name_and_through_the_seam():
    assert dspark_hf.optimize_for_cpu is optimize_for_cpu is dspark_cpu.optimize_for_cpu
    assert engine_available() and load_engine() is dspark_cpu
    assert "dspark_cpu" in engine_hooks.registered_engines()
    model = random_target("llama", num_layers=1)
    assert prepare_for_cpu(model, packed_min_rows=1) is model and is_optimized_for_cpu(model)


def test_the_profile_key_names_the_prepared_models_kernel_code(monkeypatch):
    target = random_target("llama", num_layers=1)
    monkeypatch.setattr(kernel_choices, "kernel_code_digest", lambda: "first")
    stock_key = sps_cache_key(target, 8)
    assert engine_hooks.backend_fingerprint(target) == {}
    monkeypatch.setattr(kernel_choices, "kernel_code_digest", lambda: "second")
    assert sps_cache_key(target, 8) == stock_key  # a stock model's profile does not depend on the kernels
    monkeypatch.setattr(kernel_choices, "kernel_code_digest", lambda: "first")
    prepared = optimize_for_cpu(target, packed_min_rows=1)
    fingerprint = engine_hooks.backend_fingerprint(prepared)["dspark_cpu"]
    assert fingerprint["cpu_fast_path"] and fingerprint["cpu_kernel_code"] == "first"
    prepared_key = sps_cache_key(prepared, 8)
    assert prepared_key != stock_key
    monkeypatch.setattr(kernel_choices, "kernel_code_digest", lambda: "second")
    assert sps_cache_key(prepared, 8) != prepared_key


def test_reduced_head_runs_packed_when_the_target_is_prepared_for_cpu():
    # Without this the N gathered rows take the stock multi-row CPU kernel and a reduced draft is
    # slower per round than a full-vocabulary one on a prepared target.
    target = _target()
    draft = _reduced_draft(target)
    draft.bind_target(target)
    hidden = torch.randn(1, 5, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stock = draft.draft_vocab_logits(hidden)
        cache = draft._draft_vocab_caches[0]
        assert type(gathered_head(target.lm_head, draft.draft_vocab_ids, cache)) is torch.nn.Linear
        dspark_hf.optimize_for_cpu(target, packed_min_rows=1)
        rows = gathered_head(target.lm_head, draft.draft_vocab_ids, cache)
        assert isinstance(rows, PackedLinear)  # re-gathered because the head became packed
        torch.testing.assert_close(draft.draft_vocab_logits(hidden), stock, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stock, hidden @ target.lm_head.weight[draft.draft_vocab_ids].T)
        target.lm_head.weight.mul_(2.0)  # an in-place change is seen: gathered again
        torch.testing.assert_close(draft.draft_vocab_logits(hidden), 2 * stock, rtol=1e-5, atol=1e-5)
        target.lm_head.weight.mul_(0.5)
    prompt = torch.tensor([[1, 4, 9, 2]])
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=draft), plain)


def test_reduced_head_packs_when_first_used_inside_inference_mode():
    target = _target()
    draft = _reduced_draft(target)
    draft.bind_target(target)
    optimize_for_cpu(target, packed_min_rows=1)
    hidden = torch.randn(1, 5, target.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():  # the gathered rows were built as inference tensors and could not be packed
        inside = draft.draft_vocab_logits(hidden)
    with torch.no_grad():  # and the cached rows still serve outside inference mode
        torch.testing.assert_close(draft.draft_vocab_logits(hidden), inside)
    torch.testing.assert_close(inside, hidden @ target.lm_head.weight[draft.draft_vocab_ids].T, rtol=1e-5, atol=1e-5)


def test_binding_a_prepared_pair_builds_the_reduced_head_before_the_first_generate(monkeypatch):
    # The gathered, packed rows are a one-off cost; built by bind_target (after optimize_for_cpu), the first
    # generate reuses them rather than gathering inside the user's first call.
    target = _target()
    draft = _reduced_draft(target)
    optimize_for_cpu(target, packed_min_rows=1)
    optimize_for_cpu(draft, packed_min_rows=1)
    draft.bind_target(target)
    cache = draft._draft_vocab_caches[0]
    built = cache.value
    assert isinstance(built, PackedLinear) and built.weight.shape[0] == len(draft.draft_vocab_ids)
    builds = []
    original_get = type(cache).get
    monkeypatch.setattr(type(cache), "get", lambda self, key, build: original_get(
        self, key, lambda: builds.append(key) or build()))
    prompt = torch.tensor([[1, 4, 9, 2]])
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=draft), plain)
    assert builds == [] and cache.value is built
    draft.train()
    draft.bind_target(target)  # a draft in training runs its reduced head as a plain matmul: nothing packed
    assert cache.value is built
