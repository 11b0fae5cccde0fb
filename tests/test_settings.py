"""Run-time settings come from the draft's generation_config and generate() kwargs (dspark_hf.decoding.settings)."""

import threading
import warnings

import pytest
import torch
from transformers import GenerationConfig

import dspark_hf.decoding.settings as settings
from dspark_hf import (DraftingGate, FixedLengthPolicy, PerPositionThresholdPolicy, PrefixScheduler, StepCostModel,
                       ThresholdPolicy, VerifyPolicy)
from dspark_hf.decoding.settings import resolve_drafting_gate, resolve_settings, resolve_verify_policy
from tiny_models import markov_draft, random_target, target_next_token_table

BLOCK = 4
VOCAB = 48
PROMPT = torch.tensor([[3, 17, 5, 29, 11]])


@pytest.fixture(scope="module")
def target():
    return random_target("llama")


def _draft(target, confidence=True):
    # c_k = sigmoid(logit of the previous token): confidences spread over (0.05, 0.98)
    logits = torch.linspace(-3.0, 4.0, VOCAB) if confidence else None
    return markov_draft(target, target_next_token_table(target), block_size=BLOCK, confidence_logits=logits)


def _call_config(target, generation_config=None, **kwargs):
    """The call's generation config as generate() prepares it (defaults filled in, explicit fields marked)."""
    config, _ = target._prepare_generation_config(generation_config, **kwargs)
    return config


@pytest.fixture
def stub_cost_model(monkeypatch):
    """The default scheduler's cost model without profiling the target."""
    model = StepCostModel([1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    monkeypatch.setattr(settings, "shared_cost_model", lambda target: model)
    return model


def _generate(target, draft, prompt=PROMPT, **kwargs):
    return target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=draft, **kwargs)


def _verified_lengths(draft):
    return {r.verified for r in draft.last_generation_stats.rounds if r.drafted}


# ----------------------------------------------------------------------- where settings come from
def test_draft_generation_config_fields_take_effect(target):
    draft = _draft(target)
    plain = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    draft.generation_config.dspark_verify_policy = "fixed"
    draft.generation_config.num_assistant_tokens = 2
    assert torch.equal(_generate(target, draft), plain)
    assert _verified_lengths(draft) <= {1, 2} and 2 in _verified_lengths(draft)  # 1 only where the length budget ends
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(1)
    assert torch.equal(_generate(target, draft), plain)
    assert _verified_lengths(draft) == {1}


def test_generate_kwargs_override_the_draft_generation_config(target):
    draft = _draft(target)
    plain = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(1)
    assert torch.equal(_generate(target, draft, dspark_verify_policy=FixedLengthPolicy(3)), plain)
    assert 3 in _verified_lengths(draft)
    assert torch.equal(_generate(target, draft, dspark_verify_policy="fixed"), plain)  # the block (no length set)
    assert BLOCK in _verified_lengths(draft)
    draft.generation_config.num_assistant_tokens = 1
    assert torch.equal(_generate(target, draft, dspark_verify_policy="fixed", num_assistant_tokens=3), plain)
    assert 3 in _verified_lengths(draft)
    # A generation_config passed to generate() is part of the call too.
    assert torch.equal(_generate(target, draft, generation_config=GenerationConfig(num_assistant_tokens=2,
                                                                                    max_new_tokens=16)), plain)
    assert _verified_lengths(draft) <= {1, 2}
    assert _generate(target, draft).shape == plain.shape  # the draft's own settings again
    assert _verified_lengths(draft) == {1}


def test_batched_generation_reads_the_same_settings(target):
    draft = _draft(target)
    batch = torch.tensor([[0, 3, 17, 5], [8, 21, 9, 30]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    plain = target.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = target.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=draft,
                          num_assistant_tokens=2)
    assert torch.equal(out, plain)
    assert max(r.verified for r in draft.last_generation_stats.rounds) == 2


# ------------------------------------------------------------------ transformers' assistant fields
def test_num_assistant_tokens_is_a_fixed_length_and_a_cap(target, stub_cost_model):
    draft = _draft(target)
    found = resolve_settings(draft, target, _call_config(target, num_assistant_tokens=3))
    assert isinstance(found.policy, FixedLengthPolicy) and found.policy.length == 3 and found.max_draft_tokens == 3
    assert found.gate is None and found.lookup is None  # as with FixedLengthPolicy set directly
    found = resolve_settings(draft, target, _call_config(target, num_assistant_tokens=2,
                                                         dspark_verify_policy="scheduler"))
    assert isinstance(found.policy, PrefixScheduler) and found.max_draft_tokens == 2
    off = resolve_settings(draft, target, _call_config(target, num_assistant_tokens=0))
    assert off.policy.length == 0 and off.max_draft_tokens == 0
    assert torch.equal(_generate(target, draft, num_assistant_tokens=0),
                       target.generate(PROMPT, max_new_tokens=16, do_sample=False))
    assert _verified_lengths(draft) == set()  # no round drafted


def test_candidate_generator_reports_its_longest_proposal(target, stub_cost_model):
    """transformers >= 5.25 sizes a recurrent cache's rollback by ``num_drafting_tokens``."""
    from dspark_hf.decoding.candidate_generator import DSparkCandidateGenerator

    draft = _draft(target)

    def longest(**kwargs):
        config = _call_config(target, max_new_tokens=16, **kwargs)
        config._eos_token_tensor = None  # set by generate() after the config is prepared
        return DSparkCandidateGenerator(draft, target, config, None, batch_size=1).num_drafting_tokens

    assert longest(num_assistant_tokens=3, dspark_verify_policy="scheduler", prompt_lookup_num_tokens=0) == 3
    assert longest(num_assistant_tokens=2, dspark_verify_policy="scheduler", prompt_lookup_num_tokens=7) == 7
    assert longest(num_assistant_tokens=0) == 0


def test_assistant_confidence_threshold_is_a_per_position_threshold(target):
    draft = _draft(target)
    policy = resolve_verify_policy(draft, target, 1, _call_config(target, assistant_confidence_threshold=0.6))
    assert isinstance(policy, PerPositionThresholdPolicy) and policy.threshold == 0.6
    policy = resolve_verify_policy(draft, target, 1, _call_config(target, assistant_confidence_threshold=0.6,
                                                                   dspark_verify_policy="threshold"))
    assert isinstance(policy, ThresholdPolicy) and policy.threshold == 0.6
    draft.generation_config.assistant_confidence_threshold = 0.5
    assert resolve_verify_policy(draft, target, 1, _call_config(target)).threshold == 0.5
    # Observable: the rounds verify exactly the prefix whose confidences stay >= the threshold.
    plain = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(_generate(target, draft, assistant_confidence_threshold=0.999), plain)
    assert _verified_lengths(draft) <= {0}


def test_heuristic_schedule_means_the_scheduler(target, stub_cost_model, caplog):
    draft = _draft(target)
    policy = resolve_verify_policy(draft, target, 1, _call_config(target, num_assistant_tokens_schedule="heuristic",
                                                                   num_assistant_tokens=3))
    assert isinstance(policy, PrefixScheduler)
    constant = resolve_verify_policy(draft, target, 1, _call_config(target, num_assistant_tokens_schedule="constant",
                                                                     num_assistant_tokens=3))
    assert isinstance(constant, FixedLengthPolicy)
    dflash = _draft(target, confidence=False)
    settings.logger.warning_once.cache_clear()
    with caplog.at_level("WARNING"):
        policy = resolve_verify_policy(dflash, target, 1, _call_config(target, num_assistant_tokens_schedule="heuristic"))
    assert isinstance(policy, FixedLengthPolicy) and policy.length == BLOCK
    assert any("no effect with a DFlash draft" in r.getMessage() for r in caplog.records)


def test_transformers_defaults_do_not_replace_the_scheduler(target, stub_cost_model):
    draft = _draft(target)
    config = _call_config(target)
    assert (config.num_assistant_tokens, config.assistant_confidence_threshold) == (20, 0.4)  # filled in
    found = resolve_settings(draft, target, config)
    assert isinstance(found.policy, PrefixScheduler) and found.policy.cost_model is stub_cost_model
    assert found.gate is not None and found.lookup is not None and found.max_draft_tokens == BLOCK
    dflash = resolve_settings(_draft(target, confidence=False), target, config)
    assert isinstance(dflash.policy, FixedLengthPolicy) and dflash.policy.length == BLOCK
    # The same values set explicitly do count: 20 exceeds this draft's block.
    with pytest.raises(ValueError, match=r"num_assistant_tokens=20 \(from the generate\(\) call\).*0 to 4"):
        resolve_settings(draft, target, _call_config(target, num_assistant_tokens=20))
    explicit = resolve_verify_policy(draft, target, 1, _call_config(target, assistant_confidence_threshold=0.4))
    assert isinstance(explicit, PerPositionThresholdPolicy)
    # A config that never went through generate(): only values other than transformers' defaults count.
    bare = GenerationConfig(num_assistant_tokens=20, assistant_confidence_threshold=0.4)
    assert isinstance(resolve_verify_policy(draft, target, 1, bare), PrefixScheduler)


# ------------------------------------------------------------------------------------ bad values
@pytest.mark.parametrize("kwargs,message", [
    (dict(dspark_verify_policy="sheduler"), r"dspark_verify_policy.*'scheduler', 'fixed', 'threshold'"),
    (dict(dspark_verify_policy=PrefixScheduler), r"dspark_verify_policy.*an instance"),
    (dict(num_assistant_tokens=5), r"num_assistant_tokens=5 .*0 to 4"),
    (dict(num_assistant_tokens=-1), r"num_assistant_tokens=-1 .*integer from 0 to 4"),
    (dict(num_assistant_tokens="3"), r"num_assistant_tokens='3' .*integer"),
    (dict(assistant_confidence_threshold=1.5), r"assistant_confidence_threshold=1.5 .*\[0, 1\]"),
    (dict(dspark_verify_policy="threshold"), r"dspark_verify_policy='threshold'.*needs assistant_confidence_thresh"),
    (dict(assistant_confidence_threshold=0.0, dspark_verify_policy="threshold"), r"does not suit.*\(0, 1\]"),
    (dict(num_assistant_tokens_schedule="sometimes"), r"num_assistant_tokens_schedule='sometimes'.*'heuristic'"),
    (dict(dspark_adaptive_drafting="yes"), r"dspark_adaptive_drafting.*True, False or a DraftingGate"),
    (dict(prompt_lookup_num_tokens=-2), r"prompt_lookup_num_tokens.*>= 0"),
])
def test_bad_values_name_the_field_and_the_allowed_values(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _generate(target, _draft(target), **kwargs)


def test_bad_value_on_the_draft_generation_config_says_where_it_is(target):
    draft = _draft(target)
    draft.generation_config.num_assistant_tokens = 9
    with pytest.raises(ValueError, match=r"num_assistant_tokens=9 \(from the draft's generation_config\)"):
        _generate(target, draft)


@pytest.mark.parametrize("kwargs", [dict(dspark_verify_policy="scheduler"),
                                    dict(assistant_confidence_threshold=0.5),
                                    dict(dspark_verify_policy=ThresholdPolicy(0.5))])
def test_confidence_settings_need_a_confidence_head(target, kwargs):
    with pytest.raises(ValueError, match="no confidence head.*num_assistant_tokens|no confidence head.*'fixed'"):
        _generate(target, _draft(target, confidence=False), **kwargs)


def test_unknown_or_misplaced_dspark_kwargs(target):
    with pytest.raises(ValueError, match=r"Unknown DSpark setting.*dspark_verify_polcy.*dspark_verify_policy"):
        _generate(target, _draft(target), dspark_verify_polcy="fixed")
    with pytest.raises(ValueError, match=r"DSpark settings.*no DSpark draft"):
        target.generate(PROMPT, max_new_tokens=4, dspark_verify_policy="fixed")


def test_gate_setting_from_the_call(target):
    draft = _draft(target)
    gate = DraftingGate(window=5, probe_every=7)
    found = resolve_drafting_gate(draft, FixedLengthPolicy(2), _call_config(target, dspark_adaptive_drafting=gate))
    assert found is not gate and (found.window, found.probe_every) == (5, 7)
    draft.generation_config.dspark_adaptive_drafting = True
    assert resolve_drafting_gate(draft, FixedLengthPolicy(2), _call_config(target)) is not None
    assert resolve_drafting_gate(draft, FixedLengthPolicy(2), _call_config(target, dspark_adaptive_drafting=False)) is None


# --------------------------------------------------------------------- a user policy, deprecations
class EveryOther(VerifyPolicy):
    """Verifies positions 1 and 2 when c_1 >= 0.5, else nothing (a user-defined policy)."""

    def start_round(self, trace=None):
        offered = []

        def offer(confidence):
            offered.append(confidence)
            return len(offered) <= 2 and offered[0] >= 0.5

        return offer


def test_a_user_policy_plugs_in(target):
    draft = _draft(target)
    plain = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(_generate(target, draft, dspark_verify_policy=EveryOther()), plain)
    assert _verified_lengths(draft) <= {0, 1, 2} and 2 in _verified_lengths(draft)


def test_new_settings_emit_no_deprecation_warning(target):
    draft = _draft(target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        draft.generation_config.dspark_verify_policy = "fixed"
        _generate(target, draft, num_assistant_tokens=2)
        assert draft.last_generation_stats.num_rounds > 0


def test_deprecated_attributes_warn_and_still_work(target):
    draft = _draft(target)
    with pytest.warns(FutureWarning, match=r"draft.verify_policy is deprecated.*generation_config.dspark_verify_policy"):
        draft.verify_policy = FixedLengthPolicy(1)
    assert draft.generation_config.dspark_verify_policy.length == 1
    with pytest.warns(FutureWarning, match="dspark_adaptive_drafting"):
        draft.adaptive_drafting = False
    assert draft.generation_config.dspark_adaptive_drafting is False
    _generate(target, draft)
    assert _verified_lengths(draft) == {1}
    with pytest.warns(FutureWarning, match="last_generation_stats"):
        assert draft.generation_stats is draft.last_generation_stats
    with pytest.warns(FutureWarning, match="verify_policy"):
        assert draft.verify_policy.length == 1
    with pytest.warns(FutureWarning, match="adaptive_drafting"):
        assert draft.adaptive_drafting is False


# ----------------------------------------------------------------------------------------- threads
def test_two_threads_with_one_draft_keep_their_settings_and_statistics(target):
    draft = _draft(target)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (1, 6), generator=gen) for _ in range(4)]
    expected = [target.generate(p, max_new_tokens=20, do_sample=False) for p in prompts]
    lengths = {"one": 1, "four": 4}
    results: dict[str, list] = {name: [] for name in lengths}
    errors: list[BaseException] = []
    start = threading.Barrier(len(lengths))

    def work(name: str) -> None:
        try:
            start.wait()
            for prompt in prompts:
                out = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=draft,
                                      dspark_verify_policy=FixedLengthPolicy(lengths[name]))
                results[name].append((out, draft.last_generation_stats))
        except BaseException as err:  # reported in the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(name,)) for name in lengths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for name, length in lengths.items():
        stats_seen = set()
        for (out, stats), want in zip(results[name], expected):
            assert torch.equal(out, want), name
            verified = {r.verified for r in stats.rounds}
            assert max(verified) <= length and (length == 1 or length in verified), (name, verified)
            stats_seen.add(id(stats))
        assert len(stats_seen) == len(prompts)  # a fresh record per call
    assert draft.last_generation_stats is None  # the main thread made no DSpark call
