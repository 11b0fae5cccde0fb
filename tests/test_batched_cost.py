"""The cost of a batched round as the scheduler sees it: a padded rectangle of rows x (1 + the
longest proposal); the prefill never a round; the prior extended to batched sizes; profiles never
slowed by a loaded run; the draft's context brought up to date only when the draft runs."""

import json
import math

import pytest
import torch
from transformers import GenerationConfig

import dspark_hf.decoding.batched as batched
from dspark_hf import PrefixScheduler, StepCostModel
from dspark_hf.scheduling.drafting_gate import DraftingGate, record_gate_round
from dspark_hf.scheduling.shared_cost import _ProfileDrift
from generation_helpers import left_pad
from tiny_models import markov_draft, random_target, target_next_token_table

VOCAB, BLOCK, EOS, PAD = 48, 4, 5, 0
FLAT_SPS = [1 / (1 + 0.02 * b) for b in range(80)]


class RecordingScheduler(PrefixScheduler):
    """The scheduler with a live cost model, recording what it is told and asked."""

    def __init__(self):
        super().__init__(FLAT_SPS, live=True)
        self.observed, self.widths, self.offers = [], [], []

    def observe_verify(self, num_tokens, seconds):
        self.observed.append(num_tokens)
        super().observe_verify(num_tokens, seconds)

    def admit_batch(self, confidences_per_request, *, min_width=1):
        self.widths.append(min_width)
        self.offers.append([list(c) for c in confidences_per_request])
        return super().admit_batch(confidences_per_request, min_width=min_width)


def _pair():
    target = random_target("llama", eos_token_id=EOS, context_scale=0.5)
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK,
                         confidence_logits=torch.linspace(-2, 4, VOCAB))
    return target, draft


def test_a_batched_round_is_observed_as_rows_times_its_padded_width_and_the_prefill_never(monkeypatch):
    target, draft = _pair()
    policy = RecordingScheduler()
    draft.generation_config.dspark_verify_policy = policy
    draft.generation_config.prompt_lookup_num_tokens = 6  # copies from the repeated prompts widen rounds
    # The gate reads wall-clock rates: on a loaded machine it could make every round a plain step, offering nothing.
    draft.generation_config.dspark_adaptive_drafting = False
    forwards = []  # (rows, width) of every verify forward
    original_verify = batched.BatchedDSparkGeneration.verify

    def verify(self, plan):
        result = original_verify(self, plan)
        forwards.append(tuple(result[1].shape))
        return result

    monkeypatch.setattr(batched.BatchedDSparkGeneration, "verify", verify)
    gen = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(6, VOCAB, (4,), generator=gen).tolist() * 4)[: 6 + 2 * i] for i in range(4)]
    ids, mask = left_pad(prompts, PAD)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD,
                          assistant_model=draft)
    for i, prompt in enumerate(prompts):  # still lossless
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=PAD)
        assert out[i, ids.shape[1]:].tolist()[: alone.shape[1] - len(prompt)] == alone[0, len(prompt):].tolist()
    assert policy.observed == [rows * width for rows, width in forwards]  # one per round, prefill excluded
    assert any(width > 2 for _, width in forwards), forwards
    # Lookup copies are admitted jointly with the drafted tokens (offered at their estimated
    # acceptance, one value per copy), so nothing fixes the width before the scheduler decides.
    assert set(policy.widths) == {1}
    assert any(len(offer) > 1 and len(set(offer)) == 1 for offers in policy.offers for offer in offers)
    stats = draft.last_generation_stats
    assert {r.source for r in stats.rounds} == {"dspark", "lookup"}


def test_at_batch_size_one_the_prefill_is_not_a_round_either():
    target, draft = _pair()
    policy = RecordingScheduler()
    draft.generation_config.dspark_verify_policy = policy
    target.generate(torch.tensor([[7, 8, 9, 10]]), max_new_tokens=30, do_sample=False, pad_token_id=PAD,
                    assistant_model=draft)
    stats = draft.last_generation_stats
    assert policy.observed == [1 + r.verified for r in stats.rounds]


def test_extending_the_prior_keeps_what_the_rounds_taught():
    model = StepCostModel([1.0, 1.0])
    for _ in range(20):
        model.observe(2, 2.0)  # live: twice the prior
    assert math.isclose(model.seconds(2), 2.0)
    model.extend_prior([0.5, 0.5, 0.6, 0.8])  # a longer profile, faster at B = 2
    assert model.prior_length == 4 and model.num_observations == 20
    assert math.isclose(model.seconds(2), 2.0)  # the observations still say 2 s
    assert math.isclose(model.seconds(4), 0.8 * 4.0)  # the global level (x4 over this prior) carries over


def test_a_drifted_profile_is_rewritten_only_where_the_live_times_are_faster(tmp_path):
    path = tmp_path / "profile.json"
    record = {"sps": [1.0, 0.5]}
    path.write_text(json.dumps(record))
    drift = _ProfileDrift(torch.nn.Linear(1, 1), path, record)
    slower = StepCostModel([1.0, 2.0])
    for _ in range(20):
        slower.observe(1, 50.0)  # a loaded machine: x50
    drift.rewrite(slower)
    assert json.loads(path.read_text()) == record  # untouched: load must not slow the profile down
    faster = StepCostModel([1.0, 2.0])
    for _ in range(20):
        faster.observe(1, 0.5)
        faster.observe(2, 4.0)  # faster at B = 1, slower at B = 2
    drift.rewrite(faster)
    rewritten = json.loads(path.read_text())
    fitted = rewritten["fitted_step_seconds"]
    assert fitted[0] == faster.step_seconds(2)[0] < 1.0 and fitted[1] == 2.0  # the faster size only
    assert rewritten["sps"] == [1 / fitted[0], 0.5] and rewritten["live_corrected"]["observations"] == 40


def test_the_gate_learns_rounds_it_turned_off_even_with_lookup_rows_riding_along():
    gate = DraftingGate(min_rounds=1, warmup_rounds=0)
    record_gate_round(gate, drafted=True, verified=8, produced=6, seconds=1.0, drafting_seconds=0.2, sequences=4)
    record_gate_round(gate, drafted=False, verified=5, produced=9, seconds=1.0, drafting_seconds=0.0, sequences=4)
    assert gate.drafted_rate() == 6.0 and gate.plain_rate() == 9.0  # 4 plain tokens + a lookup row's 5
    assert not gate.should_draft()


def test_the_draft_context_deferred_to_the_next_draft_equals_one_updated_every_round(monkeypatch):
    target, draft = _pair()
    draft.generation_config.prompt_lookup_num_tokens = 0
    ids, mask = left_pad([[7, 8, 9], [10, 11, 12, 13, 14]], PAD)
    caches = {}
    original_run = batched.BatchedDSparkGeneration.run
    original_roll_back = batched.BatchedDSparkGeneration.roll_back

    def run(self):
        result = original_run(self)
        self.update_draft_context()
        caches[self.eager] = (self.draft_cache, self.waited)
        return result

    def roll_back(self, *args):
        original_roll_back(self, *args)
        self.waited = max(getattr(self, "waited", 0), len(self.pending_context))
        if self.eager:
            self.update_draft_context()

    monkeypatch.setattr(batched.BatchedDSparkGeneration, "run", run)
    monkeypatch.setattr(batched.BatchedDSparkGeneration, "roll_back", roll_back)
    for eager in (False, True):
        monkeypatch.setattr(batched.BatchedDSparkGeneration, "eager", eager, raising=False)
        # No draft token this call: every round is a plain step, so the deferred context piles up.
        target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD,
                        assistant_model=draft, num_assistant_tokens=0)
    (deferred, waited), (eager, _) = caches[False], caches[True]
    assert waited > 5  # the rounds' features waited for one update
    assert deferred.length == eager.length
    assert torch.equal(deferred.key_mask, eager.key_mask)
    for mine, theirs in zip(deferred.keys + deferred.values, eager.keys + eager.values):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_a_gate_that_never_saw_a_plain_round_times_one_instead_of_trusting_the_estimate():
    gate = DraftingGate(min_rounds=2, warmup_rounds=0)
    for _ in range(3):  # every round verified something: no plain round was ever timed
        gate.record_drafted(10, 0.20)  # 8 rows, 10 tokens in 200 ms: 50 tokens/s
    assert gate.should_draft()  # batch size 1 (no estimate): nothing to compare with
    gate.plain_estimate = (8, 0.25)  # batched: the cost model says 32 tokens/s, drafting would win
    assert not gate.should_draft()  # but a profile can be off by x2: time one plain round
    gate.record_plain(0.10, tokens=8)  # 80 tokens/s
    assert not gate.should_draft()
    assert gate.plain_rate() == pytest.approx(80.0)


def test_lookup_search_rests_while_the_joint_admission_keeps_refusing_copies(monkeypatch):
    import dspark_hf.decoding.context_lookup as context_lookup

    target, draft = _pair()
    # A forward of more than 4 tokens costs ten times one of 4: no copy ever pays for 4 rows.
    draft.generation_config.dspark_verify_policy = PrefixScheduler([1.0] * 4 + [0.1] * 60)
    draft.generation_config.prompt_lookup_num_tokens = 6
    searches = []
    original = context_lookup.ContextLookup.propose
    monkeypatch.setattr(context_lookup.ContextLookup, "propose",
                        lambda self, *a: searches.append(1) or original(self, *a))
    prompts = [[7, 8, 9, 10] * 3, [11, 12, 13] * 4, [14, 15] * 5, [16, 17, 18, 19, 20] * 2]
    ids, mask = left_pad(prompts, PAD)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, pad_token_id=PAD,
                          assistant_model=draft)
    for i, prompt in enumerate(prompts):
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False, pad_token_id=PAD)
        assert out[i, ids.shape[1]:].tolist()[: alone.shape[1] - len(prompt)] == alone[0, len(prompt):].tolist()
    stats = draft.last_generation_stats
    rounds = round(sum(1 / r.batch_rows for r in stats.rounds))
    assert all(r.verified == 0 for r in stats.rounds if r.source == "lookup")
    assert rounds > 40 and len(searches) < rounds, (len(searches), rounds)  # without resting: ~4 per round


class FixedGate(DraftingGate):
    """A drafting gate with a fixed answer; every question is logged in the class's ``asked``."""

    answer = True
    asked: list[bool] = []

    def should_draft(self):
        FixedGate.asked.append(self.answer)
        return self.answer


def test_a_batched_round_the_gate_refuses_proposes_nothing_not_even_a_lookup_copy(monkeypatch):
    import dspark_hf.decoding.context_lookup as context_lookup

    target, draft = _pair()
    draft.generation_config.prompt_lookup_num_tokens = 6  # the repeated prompts offer copies
    searches = []
    original = context_lookup.ContextLookup.propose
    monkeypatch.setattr(context_lookup.ContextLookup, "propose",
                        lambda self, *a: searches.append(1) or original(self, *a))
    prompts = [[7, 8, 9, 10] * 3, [11, 12, 13] * 4, [14, 15] * 5]
    ids, mask = left_pad(prompts, PAD)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    outputs = {}
    for answer in (True, False):
        FixedGate.answer, FixedGate.asked = answer, []
        searches.clear()
        draft.generation_config.dspark_adaptive_drafting = FixedGate()
        outputs[answer] = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                          pad_token_id=PAD, assistant_model=draft)
        stats = draft.last_generation_stats
        rounds = round(sum(1 / r.batch_rows for r in stats.rounds))
        # Once per batched round, whichever source the rows take; a last round with room for its
        # bonus token only has nothing to propose and is not asked.
        assert rounds - 1 <= len(FixedGate.asked) <= rounds
        if answer:
            assert searches and any(r.source == "lookup" and r.verified for r in stats.rounds)
        else:  # every round is the target's plain batched step: no search, no copy, no draft
            assert not searches and rounds >= 29
            assert all(r.verified == 0 and not r.drafted and r.source == "dspark" for r in stats.rounds)
    for answer, out in outputs.items():
        assert torch.equal(out[:, : plain.shape[1]], plain), answer


def test_a_batched_call_gets_a_gate_with_a_margin_and_the_margin_decides_ties():
    from dspark_hf.decoding.settings import resolve_drafting_gate
    from dspark_hf.scheduling.drafting_gate import BATCHED_GATE_MARGIN

    target, draft = _pair()
    policy = PrefixScheduler(FLAT_SPS)
    assert resolve_drafting_gate(draft, policy, None, 1).margin == 0.0
    batched = resolve_drafting_gate(draft, policy, None, 4)
    assert batched.margin == BATCHED_GATE_MARGIN > 0 and batched.min_rounds == 2 and batched.probe_budget == 0.01
    gate = DraftingGate(min_rounds=1, margin=0.05, warmup_rounds=0)
    gate.record_drafted(103, 1.0)
    gate.record_plain(1.0, tokens=100)
    assert not gate.should_draft()  # 3% faster than plain steps: within the margin, plain wins
    gate.record_drafted(113, 1.0)  # now 8% faster on average
    assert gate.should_draft()


def test_a_second_call_starts_from_what_the_last_call_with_its_rows_learnt_about_drafting():
    """Counted, not timed: the first call's gate learnt that drafting loses at R = 4 (two drafted rounds
    at 20 tokens/s against plain steps at 40); the next call with 4 rows starts with plain steps, while
    a call with other rows, sampling, or another draft starts afresh (drafting its first round)."""
    from dspark_hf.decoding.settings import resolve_drafting_gate

    target, draft = _pair()
    policy = PrefixScheduler(FLAT_SPS)
    first = resolve_drafting_gate(draft, policy, None, 4)
    assert first.should_draft()  # nothing learnt yet in this process
    for _ in range(first.warmup_rounds + first.min_rounds):
        first.record_drafted(8, 0.4)
    first.record_plain(0.1, tokens=4)
    assert not first.should_draft()
    second = resolve_drafting_gate(draft, policy, None, 4)
    assert second is not first and not second.warming_up
    assert [second.should_draft() for _ in range(second.probe_interval())] == [False] * (second.probe_interval() - 1) + [True]
    assert resolve_drafting_gate(draft, policy, None, 2).should_draft()  # a smaller batch may still gain
    assert resolve_drafting_gate(draft, policy, GenerationConfig(do_sample=True), 4).should_draft()
    _, other_draft = _pair()
    assert resolve_drafting_gate(other_draft, policy, None, 4).should_draft()
    assert resolve_drafting_gate(other_draft, policy, None, 8).should_draft()  # its 4-row gate has not judged


def test_a_wider_batch_starts_where_the_nearest_smaller_one_found_drafting_lost():
    """Counted, not timed: after 4 rows found drafting lost, a first call with 8 rows starts with plain steps and
    probes as the 4-row gate did (so does 16, through 8's presumption), and its own probes overturn the presumption
    once they show drafting pays; a batch whose nearest smaller one found drafting paid starts drafting."""
    from dspark_hf.decoding.settings import resolve_drafting_gate

    target, draft = _pair()
    policy = PrefixScheduler(FLAT_SPS)
    four = resolve_drafting_gate(draft, policy, None, 4)
    for _ in range(four.warmup_rounds + four.min_rounds):
        four.record_drafted(8, 0.4)
    four.record_plain(0.1, tokens=4)
    interval = four.probe_interval()
    eight = resolve_drafting_gate(draft, policy, None, 8)
    assert eight.warming_up  # nothing of its own shapes is warm: its first probe is not counted
    assert [eight.should_draft() for _ in range(2 * interval)] == ([False] * (interval - 1) + [True]) * 2
    sixteen = resolve_drafting_gate(draft, policy, None, 16)
    assert not sixteen.should_draft()
    for _ in range(eight.warmup_rounds + eight.min_rounds):  # its probes: drafting pays at 8 rows after all
        eight.record_drafted(40, 0.2)
    eight.record_plain(0.1, tokens=8)
    assert not eight.drafting_lost() and all(eight.should_draft() for _ in range(3))
    assert resolve_drafting_gate(draft, policy, None, 12).should_draft()  # nearest smaller (8) found it paid


def test_the_batched_gate_is_not_asked_when_no_source_can_propose():
    target, draft = _pair()
    ids, mask = left_pad([[7, 8, 9, 10] * 3, [11, 12, 13] * 4], PAD)
    FixedGate.answer, FixedGate.asked = True, []
    out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD,
                          assistant_model=draft, num_assistant_tokens=0, prompt_lookup_num_tokens=0,
                          dspark_adaptive_drafting=FixedGate())
    assert FixedGate.asked == []  # nothing to propose: every round is a plain step the gate never weighs
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                             pad_token_id=PAD))


@pytest.mark.parametrize("drafting", [False, True])
def test_a_batch_that_never_drafts_never_builds_the_drafts_context(monkeypatch, drafting):
    """Counted, not timed: the prompt's context for the draft waits, like each round's, for a round that drafts;
    a batch whose gate keeps drafting off (rows finishing early included) pays none of it, and either way the
    output is the target's."""
    target, draft = _pair()
    calls = []
    original = type(draft).add_context
    monkeypatch.setattr(type(draft), "add_context", lambda self, *args, **kwargs: calls.append(1) or original(self, *args, **kwargs))
    ids, mask = left_pad([[6, 19, 47, 47, 29, 33, 19, 29], [37, 15, 12], [22, 18, 37, 21]], PAD)  # row 0 ends first
    FixedGate.answer, FixedGate.asked = drafting, []
    common = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    out = target.generate(ids, **common, assistant_model=draft, prompt_lookup_num_tokens=0,
                          dspark_adaptive_drafting=FixedGate())
    assert FixedGate.asked and set(FixedGate.asked) == {drafting}
    assert (len(calls) > 0) == drafting
    expected = target.generate(ids, **common)
    assert torch.equal(out, expected)
    assert (expected[:, ids.shape[1]:] == EOS).any()  # some row finished before the others: rows were dropped
