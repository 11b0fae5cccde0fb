"""Greedy DSpark generation is identical to the target alone, through every path of the round."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from dspark_hf import FixedLengthPolicy, PrefixScheduler, shared_cost_model
from generation_helpers import CollectingStreamer
from tiny_models import markov_draft, random_target, target_next_token_table

BLOCK = 4
VOCAB = 48


def _prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (1, int(torch.randint(2, 24, (1,), generator=gen))), generator=gen) for _ in range(n)]


def _target_and_draft(arch, **draft_kwargs):
    target = random_target(arch)
    # The draft proposes the target's next token given only the current one: right often, not always.
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK, **draft_kwargs)
    return target, draft


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_identical_to_target_all_accept_lengths(arch):
    target, draft = _target_and_draft(arch)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    accepted = [0] * (BLOCK + 1)
    for i, prompt in enumerate(_prompts(24)):
        max_new = (5, 17, 40)[i % 3]
        expected = target.generate(prompt, max_new_tokens=max_new, do_sample=False)
        got = target.generate(prompt, max_new_tokens=max_new, do_sample=False, assistant_model=draft)
        assert got.tolist() == expected.tolist(), f"prompt {i} differs"
        for k, n in enumerate(draft.last_generation_stats.accepted_length_histogram()):
            accepted[k] += n
    assert all(n > 0 for n in accepted), f"every accepted length 0..{BLOCK} must occur, got {accepted}"


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_greedy_identical_with_scheduler_and_markov_heads(head_type):
    target = random_target("qwen3", seed=1)
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK, head_type=head_type,
                         confidence_logits=torch.linspace(-3, 4, VOCAB))
    if head_type == "rnn":  # a random rnn head: proposals come from its own bias, still verified exactly
        torch.nn.init.normal_(draft.markov_head.joint_proj.weight, std=0.5)
    draft.generation_config.dspark_verify_policy = PrefixScheduler([1.0, 0.6, 0.5, 0.45, 0.42])
    scheduled = [0] * (BLOCK + 1)
    for prompt in _prompts(10, seed=1):
        expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
        got = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=draft)
        assert got.tolist() == expected.tolist()
        for k, n in enumerate(draft.last_generation_stats.scheduled_length_histogram()):
            scheduled[k] += n
    assert scheduled[0] > 0 and sum(scheduled[2:]) > 0, f"scheduler should vary the length, got {scheduled}"


def test_greedy_stops_at_eos_inside_a_block():
    target, draft = _target_and_draft("llama")
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    checked = 0
    for prompt in _prompts(12, seed=2):
        free_run = target.generate(prompt, max_new_tokens=30, do_sample=False)
        eos = free_run[0, prompt.shape[1] + 9].item()  # a token the target emits mid-generation
        expected = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos)
        got = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=draft)
        assert got.tolist() == expected.tolist()
        checked += int(expected.shape[1] < free_run.shape[1])
    assert checked > 0


def test_default_policy_profiles_and_generates():
    target, draft = _target_and_draft("llama", confidence_logits=torch.zeros(VOCAB))
    prompt = _prompts(1)[0]
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    got = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=draft)
    assert got.tolist() == expected.tolist()
    # The default scheduler reads the target's live cost model: profiled once (covering the block),
    # then corrected by every round's verify time.
    cost_model = shared_cost_model(target)
    assert cost_model.prior_length >= BLOCK + 1
    assert cost_model.num_observations == draft.last_generation_stats.num_rounds > 0


def test_dflash_draft_verifies_full_block_by_default():
    target = random_target("llama")
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK)  # no confidence head
    prompt = _prompts(1)[0]
    got = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=draft)
    assert got.tolist() == target.generate(prompt, max_new_tokens=40, do_sample=False).tolist()
    hist = draft.last_generation_stats.scheduled_length_histogram()
    assert hist[BLOCK] >= len(draft.last_generation_stats.rounds) - 1  # the last round may be cut by the length budget


def test_statistics_add_up():
    target, draft = _target_and_draft("qwen3")
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(3)
    prompt = _prompts(1, seed=5)[0]
    out = target.generate(prompt, max_new_tokens=33, do_sample=False, assistant_model=draft)
    stats = draft.last_generation_stats
    new_tokens = out.shape[1] - prompt.shape[1]
    # every generated token is an accepted draft token or one bonus token per target forward
    # (the prefill forward produces the first token and is not a drafting round)
    assert stats.accepted_tokens + stats.num_rounds + 1 == new_tokens
    assert all(r.accepted <= r.verified <= 3 for r in stats.rounds)
    assert stats.mean_accepted_length == pytest.approx((stats.accepted_tokens + stats.num_rounds) / stats.num_rounds)
    rates = stats.per_position_acceptance()
    assert len(rates) == BLOCK and all(r is None or 0.0 <= r <= 1.0 for r in rates)
    assert rates[3] is None  # position 4 was never verified with FixedLengthPolicy(3)
    assert set(stats.timings()) == {"draft_forward", "serial_sampling", "scheduler", "target_verify"}


def test_logits_processors_in_greedy_and_output_hidden_states():
    target, draft = _target_and_draft("llama")
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    prompt = _prompts(1, seed=3)[0]
    kwargs = dict(max_new_tokens=25, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3)
    expected = target.generate(prompt, **kwargs)
    assert target.generate(prompt, assistant_model=draft, **kwargs).tolist() == expected.tolist()
    out = target.generate(prompt, assistant_model=draft, output_hidden_states=True, return_dict_in_generate=True,
                          max_new_tokens=10, do_sample=False)
    ref = target.generate(prompt, output_hidden_states=True, return_dict_in_generate=True, max_new_tokens=10,
                          do_sample=False)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert len(out.hidden_states) == len(ref.hidden_states)


class _StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_streamer_and_stopping_criteria():
    target, draft = _target_and_draft("qwen3")
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    prompt = _prompts(1, seed=4)[0]
    streamer = CollectingStreamer()
    out = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=draft, streamer=streamer)
    assert streamer.tokens == prompt[0].tolist() + out[0, prompt.shape[1]:].tolist() + ["END"]
    stop = StoppingCriteriaList([_StopAfter(prompt.shape[1] + 7)])
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False, stopping_criteria=stop)
    got = target.generate(prompt, max_new_tokens=20, do_sample=False, stopping_criteria=stop, assistant_model=draft)
    # transformers' assisted loop checks the criteria once per round; DSpark cuts at the first firing position
    assert got.tolist() == expected.tolist()


def test_left_padded_single_prompt():
    target, draft = _target_and_draft("llama")
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    prompt = torch.tensor([[0, 0, 0, 5, 9, 13, 2, 7]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    expected = target.generate(prompt, attention_mask=mask, max_new_tokens=25, do_sample=False)
    got = target.generate(prompt, attention_mask=mask, max_new_tokens=25, do_sample=False, assistant_model=draft)
    assert got.tolist() == expected.tolist()
    assert draft.last_generation_stats.accepted_tokens > 0


class AlternatingGate:
    """A drafting gate that skips every other round (a decision from the past only)."""

    def __init__(self):
        self.calls = 0

    def should_draft(self):
        self.calls += 1
        return self.calls % 2 == 1

    def record_drafted(self, tokens, seconds):
        pass

    def record_plain(self, seconds, tokens=1):
        pass


def test_greedy_identical_when_the_gate_skips_drafting(monkeypatch):
    import dspark_hf.decoding.settings as settings

    monkeypatch.setattr(settings, "resolve_drafting_gate", lambda draft, policy, generation_config=None, num_rows=1: AlternatingGate())
    target, draft = _target_and_draft("llama", confidence_logits=torch.linspace(-1, 4, VOCAB))
    draft.generation_config.dspark_verify_policy = PrefixScheduler([1.0, 0.9, 0.85, 0.8, 0.78])
    for prompt in _prompts(6, seed=3):
        expected = target.generate(prompt, max_new_tokens=25, do_sample=False)
        got = target.generate(prompt, max_new_tokens=25, do_sample=False, assistant_model=draft)
        assert got.tolist() == expected.tolist()
        stats = draft.last_generation_stats
        skipped = [r for r in stats.rounds if not r.drafted]
        assert skipped and all(r.verified == 0 and r.draft_time == 0.0 for r in skipped)
        assert 0.0 < stats.drafted_fraction < 1.0


def _record_fed_positions(monkeypatch, draft) -> list[list[int]]:
    fed = []
    add_context = draft.add_context
    monkeypatch.setattr(draft, "add_context", lambda cache, hidden, positions, key_mask=None:
                        fed.append(positions[0].tolist()) or add_context(cache, hidden, positions, key_mask))
    return fed


def test_the_draft_is_fed_its_context_only_when_it_drafts(monkeypatch):
    # Plain rounds keep the target's features; the next drafting round feeds them all in one call.
    import dspark_hf.decoding.settings as settings

    monkeypatch.setattr(settings, "resolve_drafting_gate", lambda draft, policy, generation_config=None, num_rows=1: AlternatingGate())
    target, draft = _target_and_draft("llama", confidence_logits=torch.linspace(-1, 4, VOCAB))
    draft.generation_config.dspark_verify_policy = PrefixScheduler([1.0, 0.9, 0.85, 0.8, 0.78])
    fed = _record_fed_positions(monkeypatch, draft)
    for prompt in _prompts(4, seed=5):
        fed.clear()
        got = target.generate(prompt, max_new_tokens=25, do_sample=False, assistant_model=draft, prompt_lookup_num_tokens=0)
        assert got.tolist() == target.generate(prompt, max_new_tokens=25, do_sample=False).tolist()
        drafted = [r for r in draft.last_generation_stats.rounds if r.drafted]
        assert len(fed) == len(drafted) > 1
        positions = [p for call in fed for p in call]
        assert positions == list(range(len(positions)))  # every position once, in order
        assert any(len(call) > 1 for call in fed[1:])  # a plain round's token waited for the next draft


def test_features_waiting_for_the_draft_are_bounded(monkeypatch):
    import dspark_hf.decoding.settings as settings
    from dspark_hf.decoding.candidate_generator import MAX_PENDING_CONTEXT

    never = AlternatingGate()
    never.should_draft = lambda: False
    monkeypatch.setattr(settings, "resolve_drafting_gate", lambda draft, policy, generation_config=None, num_rows=1: never)
    target, draft = _target_and_draft("llama", confidence_logits=torch.linspace(-1, 4, VOCAB))
    draft.generation_config.dspark_verify_policy = PrefixScheduler([1.0, 0.9, 0.85, 0.8, 0.78])
    fed = _record_fed_positions(monkeypatch, draft)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    kwargs = dict(max_new_tokens=MAX_PENDING_CONTEXT + 20, min_new_tokens=MAX_PENDING_CONTEXT + 20, do_sample=False)
    got = target.generate(prompt, assistant_model=draft, prompt_lookup_num_tokens=0, **kwargs)
    assert got.tolist() == target.generate(prompt, **kwargs).tolist()
    assert [len(call) for call in fed] == [MAX_PENDING_CONTEXT] and fed[0][0] == 0


def test_adaptive_drafting_setting():
    from dspark_hf import DraftingGate, ThresholdPolicy
    from dspark_hf.decoding.settings import resolve_drafting_gate

    target, draft = _target_and_draft("llama", confidence_logits=torch.zeros(VOCAB))
    assert resolve_drafting_gate(draft, PrefixScheduler([1.0, 0.5])) is not None
    assert resolve_drafting_gate(draft, ThresholdPolicy(0.5)) is not None
    assert resolve_drafting_gate(draft, FixedLengthPolicy(3)) is None
    draft.generation_config.dspark_adaptive_drafting = False
    assert resolve_drafting_gate(draft, PrefixScheduler([1.0, 0.5])) is None
    draft.generation_config.dspark_adaptive_drafting = DraftingGate(window=5, probe_every=7)
    gate = resolve_drafting_gate(draft, FixedLengthPolicy(3))
    assert gate is not draft.generation_config.dspark_adaptive_drafting and (gate.window, gate.probe_every) == (5, 7)
    draft.generation_config.dspark_adaptive_drafting = "yes"
    with pytest.raises(ValueError, match="adaptive_drafting"):
        resolve_drafting_gate(draft, FixedLengthPolicy(3))
