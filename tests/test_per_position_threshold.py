"""PerPositionThresholdPolicy: DeepSpec's --confidence-threshold rule (cut at the first position
whose own confidence is below the threshold), next to ThresholdPolicy (running product)."""

import pytest
import torch

from dspark_hf import PerPositionThresholdPolicy, ThresholdPolicy
from generation_helpers import offered_count


def test_worked_example_from_the_issue():
    confidences = [0.7] * 5
    assert PerPositionThresholdPolicy(0.5).admit(confidences) == 5  # DeepSpec's rule
    assert ThresholdPolicy(0.5).admit(confidences) == 1  # survival 0.7, then 0.49 < 0.5


def test_cuts_at_the_first_position_below_the_threshold():
    policy = PerPositionThresholdPolicy(0.5)
    assert policy.requires_confidences is True
    assert policy.admit([0.9, 0.4, 0.9, 0.9]) == 1  # never looks past the first failure
    assert policy.admit([0.5, 0.5, 0.5]) == 3  # equal to the threshold is admitted
    assert policy.admit([0.49]) == 0
    assert policy.admit([]) == 0
    assert policy.admit(torch.tensor([0.6, 0.55, 0.2])) == 2
    assert policy.admit_batch([[0.7] * 5, [0.1], [0.9, 0.3]]) == [5, 0, 1]
    assert PerPositionThresholdPolicy(0.0).admit([0.0, 0.01, 1.0]) == 3
    assert PerPositionThresholdPolicy(1.0).admit([1.0, 0.999]) == 1
    offer = policy.start_round()
    assert offer(float("nan")) is False
    trace = []
    offer = policy.start_round(trace)
    assert [offer(c) for c in (0.8, 0.3)] == [True, False] and trace == [0.8, 0.3]


def test_bad_thresholds_and_confidences_raise():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            PerPositionThresholdPolicy(bad)
    with pytest.raises(ValueError, match="probabilities in \\[0, 1\\]"):
        PerPositionThresholdPolicy(0.5).admit([0.9, 1.2])


def test_incremental_offer_matches_admit_and_is_non_anticipating():
    policy = PerPositionThresholdPolicy(0.4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        confidences = torch.rand(int(torch.randint(0, 7, (1,), generator=gen)), generator=gen).tolist()
        keep = offered_count(policy, confidences)
        assert keep == policy.admit(confidences)
        # admitting position k depends on c_1..c_k only: changing later confidences changes nothing
        if keep < len(confidences):
            changed = confidences[: keep + 1] + [1.0] * (len(confidences) - keep - 1)
            assert policy.admit(changed) == keep
