"""Context lookup in batched generation: each row chooses its own source, losslessly.

Greedy: every row equals its prompt generated alone, on copy-heavy prompts of different lengths
where one kind of row copies (lookup) and another drafts. Sampling: a chi-square test per row with
both sources in use, and the same test rejects a variant whose choice peeks at the drafted tokens.
Settings: the batch-1 switches (``prompt_lookup_num_tokens``, the draft's ``generation_config``)
work batched too.
"""

import pytest
import torch

import dspark_hf.decoding.batched as batched
from dspark_hf import FixedLengthPolicy, PrefixScheduler
from dspark_hf.decoding.context_lookup import ContextLookup
from dspark_hf.scheduling.policies import offer_until_refused
from dspark_hf.decoding.rounds import cut_after_first_eos
from dspark_hf.decoding.sampling import SerialSample
from generation_helpers import left_pad
from test_batched import BATCH_SPS, _batched_p_values
from test_context_lookup import EagerChooser
from tiny_models import bigram_target, markov_draft, random_target, target_next_token_table

VOCAB, PAD = 24, 23
# Verifying more costs little, for a whole padded batch too (B = rows x width): DSpark's value is its acceptance.
FLAT_SPS = [100.0 - 0.25 * b for b in range(128)]


def _two_region_pair(block_size=6):
    """A bigram target over two regions: tokens 0-11 run around two 6-cycles, tokens 12-23 around
    one 12-cycle. The draft knows region B exactly (confident) and guesses in region A (unsure), so
    rows in region A gain from copying and rows in region B from drafting."""
    table = torch.full((VOCAB, VOCAB), -4.0)
    for t in range(12):
        table[t, (t + 1) % 6 + (t // 6) * 6] = 4.0
    for t in range(12, VOCAB):
        table[t, 12 + (t - 11) % 12] = 4.0
    target = bigram_target(table)
    draft_table = table.clone()
    draft_table[:12] = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(0))
    confidence = torch.cat([torch.full((12,), -3.0), torch.full((12,), 4.0)])
    return target, markov_draft(target, draft_table, block_size=block_size, confidence_logits=confidence)


# Region A rows restate a cycle (copy-heavy); region B rows are short. Different lengths: left padding.
ROWS = [[0, 1, 2, 3, 4, 5, 0, 1], [12, 13], [6, 7, 8, 9, 10, 11, 6, 7, 8, 9, 10, 11, 6], [20]]
COPYING, DRAFTING = (0, 2), (1, 3)


def _generate(target, draft, prompts, max_new=40, **kwargs):
    ids, mask = left_pad(prompts, PAD)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=PAD,
                          assistant_model=draft, **kwargs)
    return [out[i, ids.shape[1]:].tolist() for i in range(len(prompts))]


def _alone(target, prompt, max_new=40):
    return target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                           pad_token_id=PAD)[0, len(prompt):].tolist()


def test_greedy_rows_identical_and_each_row_chooses_its_own_source():
    target, draft = _two_region_pair()
    draft.generation_config.dspark_verify_policy = PrefixScheduler(FLAT_SPS)
    # the drafting gate reads wall-clock rates; off, so the source shares below do not depend on load
    draft.generation_config.dspark_adaptive_drafting = False
    rows = _generate(target, draft, ROWS, prompt_lookup_num_tokens=8)
    for i, prompt in enumerate(ROWS):
        assert rows[i] == _alone(target, prompt), f"row {i}"
    stats = draft.last_generation_stats
    for r in COPYING:
        assert stats.source_shares(row=r).get("lookup", 0.0) > 0.7, (r, stats.source_shares(row=r))
    # Drafting rows draft while copying rows copy in the same rounds; once a drafting row's own
    # 12-cycle has come round, copying it pays there too.
    for r in DRAFTING:
        first_rounds = [s.source for s in stats.rounds if s.row == r][:2]
        assert first_rounds == ["dspark", "dspark"], (r, first_rounds)
        assert stats.source_shares(row=r).get("dspark", 0.0) >= 0.3, (r, stats.source_shares(row=r))
    lookup_rounds = [s for s in stats.rounds if s.source == "lookup"]
    assert sum(s.verified for s in lookup_rounds) > 3 * len(lookup_rounds)  # whole phrases are copied
    assert stats.acceptance_by_source()["lookup"] > 0.9


def test_greedy_identical_with_a_context_dependent_target_and_ragged_caches(monkeypatch):
    compactions = []
    original = batched._compact
    monkeypatch.setattr(batched, "_compact", lambda *a: compactions.append(1) or original(*a))
    target = random_target("llama", vocab_size=48, eos_token_id=5, context_scale=0.5)
    draft = markov_draft(target, target_next_token_table(target), block_size=4,
                         confidence_logits=torch.linspace(-2, 4, 48))
    draft.generation_config.dspark_verify_policy = PrefixScheduler(FLAT_SPS)
    monkeypatch.setattr(batched, "SourceChooser", EagerChooser)
    prompts = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [30, 31], [12, 40, 12, 40, 12, 40, 12], [44, 45, 46]]
    rows = _generate(target, draft, prompts, max_new=50, prompt_lookup_num_tokens=6)
    for i, prompt in enumerate(prompts):
        alone = _alone(target, prompt, 50)
        assert rows[i][: len(alone)] == alone and all(t == PAD for t in rows[i][len(alone):]), f"row {i}"
    assert "lookup" in draft.last_generation_stats.source_shares()
    assert compactions, "the ragged caches should have been compacted at least once"


def test_no_draft_forward_when_every_row_copies():
    target, draft = _two_region_pair()
    draft.generation_config.dspark_verify_policy = PrefixScheduler(FLAT_SPS)
    draft.generation_config.dspark_adaptive_drafting = False  # only the source choice may skip the draft
    calls = {"draft": 0, "target": 0}
    draft.register_forward_hook(lambda *a: calls.__setitem__("draft", calls["draft"] + 1))
    target.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1))
    prompts = [ROWS[0], ROWS[2]]
    rows = _generate(target, draft, prompts, prompt_lookup_num_tokens=8)
    assert rows == [_alone(target, p) for p in prompts]
    rounds = calls["target"] - 1  # less the prefill
    assert calls["draft"] < rounds - 2, calls


def test_settings_follow_the_batch_one_switches():
    target, draft = _two_region_pair()
    draft.generation_config.dspark_verify_policy = PrefixScheduler(FLAT_SPS, live=True)  # the live default: lookup on by default
    expected = [_alone(target, p) for p in ROWS]
    assert _generate(target, draft, ROWS) == expected
    assert "lookup" in draft.last_generation_stats.source_shares()
    assert _generate(target, draft, ROWS, prompt_lookup_num_tokens=0) == expected
    assert "lookup" not in draft.last_generation_stats.source_shares()  # 0 turns it off
    draft.generation_config.prompt_lookup_num_tokens = 0
    assert _generate(target, draft, ROWS) == expected
    assert "lookup" not in draft.last_generation_stats.source_shares()  # so does the draft's generation_config
    draft.generation_config.prompt_lookup_num_tokens = None
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(2)
    assert _generate(target, draft, ROWS) == expected
    assert "lookup" not in draft.last_generation_stats.source_shares()  # off by default with a fixed length
    assert _generate(target, draft, ROWS, prompt_lookup_num_tokens=3) == expected
    lookup_rounds = [s for s in draft.last_generation_stats.rounds if s.source == "lookup"]
    assert lookup_rounds and max(s.verified for s in lookup_rounds) <= 3
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        _generate(target, draft, ROWS, max_new=4, prompt_lookup_num_tokens=-2)


# ------------------------------------------------------------------------------------- sampling
LOOKUP_ROWS = [[0, 1, 2, 3, 2, 0, 3, 1, 2], [3, 1, 0, 2, 3], [1, 2, 0, 1]]  # last tokens 2, 3, 1; all recur


def test_batched_sampling_lossless_with_both_sources(monkeypatch):
    monkeypatch.setattr(batched, "SourceChooser", EagerChooser)
    p_values, _ = _batched_p_values(PrefixScheduler(BATCH_SPS), rows=LOOKUP_ROWS, prompt_lookup_num_tokens=3)
    sources = _batched_p_values.sources
    assert sources.get("lookup", 0) > 1000 and sources.get("dspark", 0) > 1000, sources
    assert min(p_values) > 1e-3, f"a row deviates from the target distribution with context lookup: p = {p_values}"


class PeekingGeneration(batched.BatchedDSparkGeneration):
    """A biased variant: drafts every row first, then switches a row to its lookup proposal when
    its first drafted token is 0, so whether the drafted tokens are verified depends on them."""

    def schedule(self, plan):
        super().schedule(plan)
        if not plan.drafting:
            return
        kept = []
        for j, i in enumerate(plan.draft_rows.tolist()):
            r = self.rows[i]
            end = self.prompt_len + self.num_generated[r]
            proposal = ContextLookup(max_tokens=3).propose(self.sequences[r, self.first_real[r]: end], 3)
            if plan.lengths[i] > 0 and int(plan.sample.tokens[j, 0]) == 0 and proposal is not None:
                plan.lookups[i], plan.lengths[i] = proposal, proposal.tokens.numel()
            else:
                kept.append(j)
        index = torch.tensor(kept, dtype=torch.long)
        sample = plan.sample
        plan.draft_rows = plan.draft_rows[index]
        plan.sample = SerialSample(tokens=sample.tokens[index], logits=sample.logits[index],
                                   confidences=sample.confidences[index] if sample.confidences is not None else None)


def test_a_batched_choice_that_peeks_at_drafted_tokens_is_detected(monkeypatch):
    monkeypatch.setattr(batched, "BatchedDSparkGeneration", PeekingGeneration)
    p_values, _ = _batched_p_values(PrefixScheduler(BATCH_SPS), rows=LOOKUP_ROWS, prompt_lookup_num_tokens=0)
    assert _batched_p_values.sources.get("lookup", 0) > 500  # the peeking switch happened
    assert min(p_values) < 1e-5, f"the test failed to detect a source choice that peeks at drafted tokens: {p_values}"


# ------------------------------------------------------------------------------------- shared pieces
def test_eos_cut_and_offer_until_refused():
    tokens = torch.tensor([[4, 5, 6, 5], [1, 2, 3, 4], [5, 1, 1, 1]])
    eos = torch.tensor([5])
    assert cut_after_first_eos(tokens, torch.tensor([4, 4, 0]), eos).tolist() == [2, 4, 0]
    assert cut_after_first_eos(tokens, torch.tensor([1, 3, 2]), eos).tolist() == [1, 3, 1]
    assert cut_after_first_eos(tokens, torch.tensor([3, 3, 3]), None).tolist() == [3, 3, 3]
    offered = []
    assert offer_until_refused(lambda c: c > 0.5, [0.9, 0.8, 0.2, 0.9], offered=offered) == 2
    assert offered == [0.9, 0.8, 0.2]  # the refused one is offered, nothing after it
