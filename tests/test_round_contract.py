"""The round contract both generation loops share (``dspark_hf.decoding.rounds``): one ``RoundDecisions``
decides each row's budget and verified length, at batch size 1 and batched alike."""

import logging
import math

import torch

from dspark_hf.scheduling.policies import FixedLengthPolicy, ThresholdPolicy
from dspark_hf.decoding.rounds import DSparkGenerationStats, RoundDecisions
from dspark_hf.decoding.serial_block import NON_FINITE_DRAFT_WARNING, SerialSample
from dspark_hf.decoding.settings import DSparkSettings

EOS = torch.tensor([5])


def _decisions(policy, *, batched, max_draft_tokens=4):
    settings = DSparkSettings(policy=policy, gate=None, lookup=None, max_draft_tokens=max_draft_tokens)
    return RoundDecisions(settings, None, EOS, DSparkGenerationStats(block_size=4), batched=batched)


def _sample():
    """Row 0: position 3 has a NaN logit. Row 1: an EOS drafted at position 2."""
    logits = torch.zeros(2, 4, 6)
    logits[0, 2, 1] = float("nan")
    tokens = torch.tensor([[1, 2, 3, 4], [1, 5, 2, 3]])
    return SerialSample(tokens=tokens, logits=logits, confidences=torch.full((2, 4), 0.75))


def _admit(decisions, sample, rows, room):
    plan = decisions.start(torch.zeros(len(room), dtype=torch.long), room)
    plan.drafting, plan.draft_rows, plan.sample = True, torch.tensor(rows), sample
    decisions.admit(plan)
    return plan


def test_both_loops_cut_at_the_first_non_finite_position_and_after_the_first_eos(caplog):
    decisions = _decisions(FixedLengthPolicy(4), batched=True)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # two rounds of one call: one warning
            batched = _admit(decisions, _sample(), [0, 1], [10, 10])
    assert sum(NON_FINITE_DRAFT_WARNING in r.getMessage() for r in caplog.records) == 1
    assert batched.budgets == [4, 4] and batched.admitted == [4, 4] and batched.lengths == [2, 2]
    assert batched.offered == [[0.75, 0.75, 0.0, 0.0], [0.75] * 4]  # 0.0 from the first non-finite position on
    sample = _sample()
    single = SerialSample(tokens=sample.tokens[:1], logits=sample.logits[:1], confidences=sample.confidences[:1])
    one = _admit(_decisions(FixedLengthPolicy(4), batched=False), single, [0], [10])
    assert (one.offered, one.admitted, one.lengths) == (batched.offered[:1], [4], [2])


def test_the_budget_follows_the_length_limit():
    decisions = _decisions(ThresholdPolicy(0.5), batched=True)
    assert decisions.drafting_rows(decisions.start(torch.zeros(2, dtype=torch.long), [1, 3])) == [1]
    sample = _sample()
    row_one = SerialSample(tokens=sample.tokens[1:], logits=sample.logits[1:], confidences=sample.confidences[1:])
    plan = _admit(decisions, row_one, [1], [1, 3])
    assert plan.budgets == [0, 2] and plan.offered == [[0.75, 0.75]] and plan.lengths == [0, 2]
    assert plan.source(0) == plan.source(1) == "dspark"


def test_an_incremental_round_keeps_the_loop_decision_and_warns_on_a_refused_nan(caplog):
    decisions = _decisions(ThresholdPolicy(0.5), batched=False)
    assert decisions.incremental
    sample = SerialSample(tokens=torch.tensor([[1, 2]]), logits=torch.zeros(1, 2, 6),
                          confidences=torch.tensor([[0.9, 0.9, float("nan")]]), num_admitted=2,
                          offered=[0.9, 0.9, float("nan")])
    with caplog.at_level(logging.WARNING):
        plan = _admit(decisions, sample, [0], [10])
    assert plan.admitted == [2] and plan.lengths == [2]
    assert plan.offered[0][:2] == [0.9, 0.9] and math.isnan(plan.offered[0][2])
    assert any(NON_FINITE_DRAFT_WARNING in r.getMessage() for r in caplog.records)
