"""Context lookup as a second draft source: proposals, the value-based choice, settings, and
losslessness (greedy identity on copy-heavy text; chi-square with both sources, and a choice that
peeks at the draft's tokens is detected)."""

import pytest
import torch

import dspark_hf.decoding.candidate_generator as candidate_generator
from dspark_hf import FixedLengthPolicy, PrefixScheduler
from dspark_hf.decoding.context_lookup import (PRIOR_DSPARK_TOKENS, ContextLookup, LookupProposal, SourceChooser,
                                               expected_value)
from test_lossless_sampling import SPS, _chi_square_p_value
from tiny_models import bigram_target, markov_draft


def test_proposal_is_the_continuation_of_the_most_recent_longest_match():
    lookup = ContextLookup(max_tokens=3, max_ngram=3)
    seq = torch.tensor([5, 6, 7, 1, 9, 9, 5, 6, 7, 2, 3, 4, 8, 5, 6, 7])
    proposal = lookup.propose(seq, limit=10)
    assert proposal.ngram == 3 and proposal.tokens.tolist() == [2, 3, 4]  # the later "5 6 7" wins
    assert lookup.propose(seq, limit=2).tokens.tolist() == [2, 3]
    assert lookup.propose(torch.tensor([1, 2, 3, 4]), limit=5) is None  # no earlier occurrence of 4
    short = lookup.propose(torch.tensor([1, 2, 9, 3, 2]), limit=5)
    assert short.ngram == 1 and short.tokens.tolist() == [9, 3, 2]
    far = torch.tensor([1, 2, 3, 9, 1, 2, 3])
    assert ContextLookup(max_tokens=3).propose(far, 5).tokens.tolist() == [9, 1, 2]
    assert ContextLookup(max_tokens=3, search_window=4).propose(far, 5) is None  # the match lies outside


def test_acceptance_estimate_and_expected_value():
    lookup = ContextLookup(prior_acceptance=0.5, follow_prior_acceptance=0.8, prior_weight=2.0)
    assert lookup.acceptances(2) == (pytest.approx(0.5), pytest.approx(0.8))
    lookup.record(2, verified=4, accepted=4)  # first accepted, 3 later ones accepted
    lookup.record(2, verified=3, accepted=1)  # first accepted, the second rejected
    lookup.record(2, verified=5, accepted=0)  # the first rejected: says nothing about later tokens
    lookup.record(2, verified=0, accepted=0)  # nothing verified: nothing learnt
    first, follow = lookup.acceptances(2)
    assert first == pytest.approx((2 + 1) / (3 + 2)) and follow == pytest.approx((3 + 1.6) / (4 + 2))
    assert lookup.acceptances(3) == (pytest.approx(0.5), pytest.approx(0.8))
    flat = (10.0, 10.0, 10.0, 10.0)
    assert expected_value(0.5, 0.5, flat, 3) == (3, pytest.approx(10.0 * (1 + 0.5 + 0.25 + 0.125)))
    assert expected_value(0.5, 0.9, flat, 3) == (3, pytest.approx(10.0 * (1 + 0.5 * (1 + 0.9 + 0.81))))
    steep = (10.0, 4.0, 3.0, 2.0)
    assert expected_value(0.5, 0.5, steep, 3) == (0, 10.0)
    # Two tokens cost 1.4 steps, six 1.7: a copy that, once started, goes on is worth verifying
    # whole; with one rate for every position (0.5) three tokens were the best.
    curve = (10.0, 7.0, 6.5, 6.2, 6.0, 5.8)
    assert expected_value(0.5, 0.95, curve, 5)[0] == 5
    assert expected_value(0.5, 0.5, curve, 5)[0] == 3
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        ContextLookup(max_tokens=0)
    with pytest.raises(ValueError, match="follow_prior_acceptance"):
        ContextLookup(follow_prior_acceptance=1.0)


def test_chooser_prior_for_dspark_then_history_and_probes():
    flat = (10.0,) * 12
    proposal = ContextLookup().propose(torch.tensor([1, 2, 3, 1, 2]), 5)
    assert proposal.tokens.tolist() == [3, 1, 2]
    # No DSpark round yet: prior rounds of PRIOR_DSPARK_TOKENS per plain step stand in (15 tokens/s here).
    confident = SourceChooser(ContextLookup(prior_acceptance=0.9), min_rounds=2, probe_every=3)
    assert confident.dspark_rate(flat) == pytest.approx(PRIOR_DSPARK_TOKENS * 10.0)
    assert confident.choose(proposal, flat) == 3  # lookup worth ~3.4 x 10: a copy from the first round
    doubtful = SourceChooser(ContextLookup(prior_acceptance=0.2), min_rounds=2, probe_every=3)
    assert doubtful.choose(proposal, flat) == 0  # worth ~1.25 x 10 < 15: draft
    doubtful.record_dspark(1, 0, 1.0, flat)
    assert doubtful.dspark_rate(flat) == pytest.approx((1 + PRIOR_DSPARK_TOKENS) * 10.0 / 2)
    doubtful.record_dspark(1, 0, 1.0, flat)  # measured: DSpark delivers 10 tokens/s, below lookup's 12.5
    assert doubtful.dspark_rate(flat) == pytest.approx(10.0) and doubtful.choose(proposal, flat) == 3
    doubtful.record_lookup(proposal, 1, 0)
    doubtful.record_lookup(proposal, 1, 0)
    assert doubtful.choose(proposal, flat) == 0  # the probe: DSpark again after 2 lookup rounds
    assert doubtful.choose(None, flat) == 0


def test_copy_in_progress_has_its_own_acceptance_estimate():
    lookup = ContextLookup(prior_acceptance=0.5, continuing_prior_acceptance=0.8, follow_prior_acceptance=0.7,
                           prior_weight=2.0)
    chooser = SourceChooser(lookup, probe_every=100)
    proposal = LookupProposal(tokens=torch.arange(6), ngram=3)
    assert chooser.confidences(proposal, 3) == pytest.approx([0.5, 0.7, 0.7])
    chooser.record_lookup(proposal, 6, 2)  # a fresh match, broken after 2 tokens
    assert not chooser.copying
    assert chooser.confidences(proposal, 2) == pytest.approx([(1 + 1) / (1 + 2), (1 + 1.4) / (2 + 2)])
    chooser.record_lookup(proposal, 6, 6)  # a fresh match accepted whole: the next round continues it
    assert chooser.copying and chooser.confidences(proposal, 1) == pytest.approx([0.8])
    chooser.record_lookup(proposal, 6, 6)  # counted as a continuing round
    assert chooser.confidences(proposal, 1) == pytest.approx([(1 + 1.6) / (1 + 2)])
    chooser.record_lookup(proposal, 6, 0)  # the copy breaks at once: counted as continuing, then fresh again
    assert not chooser.copying and chooser.confidences(proposal, 1) == pytest.approx([(2 + 1) / (2 + 2)])
    assert lookup.acceptances(3, continuing=True)[0] == pytest.approx((1 + 1.6) / (2 + 2))
    # Later tokens are counted per state too: the continuing round accepted 5 after its first.
    assert lookup.acceptances(3, continuing=True)[1] == pytest.approx((5 + 1.4) / (5 + 2))
    assert lookup.acceptances(3)[1] == pytest.approx((1 + 5 + 1.4) / (1 + 5 + 1 + 2))
    chooser.record_lookup(proposal, 6, 6)
    chooser.record_dspark(2, 3, 1.1, (10.0,) * 8)  # a DSpark round in between ends the copy
    assert not chooser.copying


def test_occurrence_whose_match_reaches_furthest_back_wins():
    lookup = ContextLookup(max_tokens=2, max_ngram=2)
    # "7 8" occurs twice before the end; the first occurrence is preceded by "4 5 6" like the end is.
    seq = torch.tensor([4, 5, 6, 7, 8, 1, 2, 9, 7, 8, 3, 3, 0, 4, 5, 6, 7, 8])
    assert lookup.propose(seq, 5).tokens.tolist() == [1, 2]  # the copy source, not the latest "7 8"
    latest = torch.tensor([9, 7, 8, 1, 2, 9, 7, 8, 3, 4, 9, 7, 8])  # equal reach: the latest wins
    assert lookup.propose(latest, 5).tokens.tolist() == [3, 4]
    assert ContextLookup(max_tokens=2, max_ngram=2, max_context=2).propose(seq, 5).tokens.tolist() == [3, 3]


def _cycle_target():
    """A bigram target that repeats a cycle of 6 tokens: its own output is copy-heavy."""
    vocab = 24
    table = torch.full((vocab, vocab), -4.0)
    for t in range(vocab):
        table[t, (t + 1) % 6 + (t // 6) * 6] = 4.0
    return bigram_target(table)


def _copying_pair():
    target = _cycle_target()
    weak_table = torch.randn(24, 24)  # a draft that is mostly wrong, so lookup pays more
    draft = markov_draft(target, weak_table, block_size=4, confidence_logits=torch.full((24,), 1.0))
    return target, draft


def test_greedy_identical_and_lookup_used_on_copy_heavy_text():
    target, draft = _copying_pair()
    draft.generation_config.dspark_verify_policy = PrefixScheduler([100.0, 99.0, 98.0, 97.0, 96.0], live=True)
    used = 0
    for start in (0, 3, 7, 13, 20):
        prompt = torch.tensor([[start, (start + 5) % 24, start]])
        expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
        got = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=draft)
        assert got.tolist() == expected.tolist()
        stats = draft.last_generation_stats
        used += stats.source_shares().get("lookup", 0.0) > 0
        if "lookup" in stats.acceptance_by_source():
            assert stats.acceptance_by_source()["lookup"] > 0.5
    assert used >= 3


def test_settings_follow_transformers_prompt_lookup_options():
    target, draft = _copying_pair()
    prompt = torch.tensor([[1, 2, 1]])
    draft.generation_config.dspark_verify_policy = PrefixScheduler([100.0] * 11, live=True)
    target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=draft, prompt_lookup_num_tokens=0)
    assert "lookup" not in draft.last_generation_stats.source_shares()  # 0 turns it off
    draft.generation_config.prompt_lookup_num_tokens = 0
    target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=draft)
    assert "lookup" not in draft.last_generation_stats.source_shares()  # so does the draft's generation_config
    draft.generation_config.prompt_lookup_num_tokens = None
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(2)
    target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=draft)
    assert "lookup" not in draft.last_generation_stats.source_shares()  # off by default with a fixed length
    out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=draft, prompt_lookup_num_tokens=3)
    assert out.tolist() == target.generate(prompt, max_new_tokens=40, do_sample=False).tolist()
    lookup_rounds = [r for r in draft.last_generation_stats.rounds if r.source == "lookup"]
    assert lookup_rounds and max(r.verified for r in lookup_rounds) <= 3
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        target.generate(prompt, max_new_tokens=8, assistant_model=draft, prompt_lookup_num_tokens=-2)


class EagerChooser(SourceChooser):
    """The real chooser with little DSpark history needed and an optimistic lookup prior, so both
    sources run within the few rounds of a short generation (its choices read past rounds only)."""

    def __init__(self, lookup):
        lookup._prior = [(1.8, 0.2)] * 3  # first tokens of fresh matches and of copies in progress, later tokens
        super().__init__(lookup, min_rounds=1, probe_every=3)


LOOKUP_PROMPT = torch.tensor([[0, 1, 2, 3, 2, 0, 3, 1, 2]])  # every token has an earlier occurrence


def test_sampling_lossless_with_both_sources(monkeypatch):
    monkeypatch.setattr(candidate_generator, "SourceChooser", EagerChooser)
    p_value, _ = _chi_square_p_value(PrefixScheduler(SPS), prompt=LOOKUP_PROMPT, prompt_lookup_num_tokens=3)
    sources = _chi_square_p_value.sources
    assert sources.get("lookup", 0) > 500 and sources.get("dspark", 0) > 500, sources
    assert p_value > 1e-3, f"DSpark with context lookup deviates from the target (p={p_value:.2e})"


class PeekingGenerator(candidate_generator.DSparkCandidateGenerator):
    """A biased variant: drafts first, and switches to the lookup proposal when the draft's first
    token is 0, so whether the draft's tokens are verified depends on those very tokens."""

    def get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = super().get_candidates(input_ids, *args, **kwargs)
        cur_len = input_ids.shape[1]
        if candidates.shape[1] > cur_len and logits is not None and int(candidates[0, cur_len]) == 0:
            proposal = ContextLookup(max_tokens=3).propose(input_ids[0], candidates.shape[1] - cur_len)
            if proposal is not None:
                self.plan.lengths[0] = proposal.tokens.numel()
                return torch.cat([input_ids, proposal.tokens[None]], dim=1), None
        return candidates, logits


def test_a_choice_that_peeks_at_draft_tokens_is_detected(monkeypatch):
    monkeypatch.setattr(candidate_generator, "DSparkCandidateGenerator", PeekingGenerator)
    p_value, _ = _chi_square_p_value(PrefixScheduler(SPS), prompt=LOOKUP_PROMPT, prompt_lookup_num_tokens=0)
    assert p_value < 1e-5, f"the test failed to detect a source choice that peeks at draft tokens (p={p_value:.2e})"


def test_statistics_count_lookup_rounds_longer_than_the_block():
    from dspark_hf.decoding.rounds import DSparkGenerationStats, RoundStats

    stats = DSparkGenerationStats(block_size=3)
    stats.rounds.append(RoundStats(2, 1, 0.0, 0.0, 0.0, 0.0))
    stats.rounds.append(RoundStats(10, 7, 0.0, 0.0, 0.0, 0.0, drafted=False, source="lookup"))
    assert stats.scheduled_length_histogram() == [0, 0, 1] + [0] * 7 + [1]
    assert stats.accepted_length_histogram()[7] == 1 and sum(stats.accepted_length_histogram()) == 2
