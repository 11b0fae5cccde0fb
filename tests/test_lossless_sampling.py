"""Sampling is lossless: DSpark output follows the target's exact distribution.

The target is a real transformers model computing a designed bigram table, so the exact
probability of every 3-token continuation is known by enumeration. The draft proposes from a
different table, and its confidence ``c_k`` depends strongly on ``x_{k-1}``, so the scheduler admits
0..gamma tokens from round to round. A chi-square test compares the generated continuations with
the exact distribution. The same test with an anticipating scheduler (global best over all k, no
early stop: paper Appendix A) must detect the bias, which shows the test has the power to fail.
"""

import itertools

import pytest
import torch

from dspark_hf import PrefixScheduler, StepCostModel
from dspark_hf.scheduler import DraftingGate, VerifyPolicy
from tiny_models import bigram_target, markov_draft

TARGET_PROBS = torch.tensor(
    [[0.5, 0.2, 0.2, 0.1], [0.7, 0.3, 0.0, 0.0], [0.1, 0.3, 0.3, 0.3], [0.6, 0.1, 0.1, 0.2]]
)
DRAFT_PROBS = torch.tensor(
    [[0.4, 0.3, 0.2, 0.1], [0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.3, 0.3, 0.2, 0.2]]
)
CONFIDENCE_LOGITS = torch.tensor([3.0, -4.0, 0.4, 1.7])  # c = 0.95, 0.02, 0.60, 0.85 by previous token
SPS = [1.0, 0.62, 0.5, 0.42]
PROMPT = torch.tensor([[2]])
NUM_TOKENS = 3  # tokens compared; generation runs 3 further so the length budget never limits drafting
NUM_SAMPLES = 2000


class AnticipatingScheduler(VerifyPolicy):
    """The biased variant: looks at every prefix length before deciding (no early stop)."""

    requires_confidences = True

    def __init__(self, sps):
        self.sps = sps

    def admit(self, confidences):
        best, keep, expected, survival = self.sps[0], 0, 1.0, 1.0
        for k, c in enumerate(confidences, start=1):
            survival *= c
            expected += survival
            if self.sps[k] * expected > best:
                best, keep = self.sps[k] * expected, k
        return keep


def _log(p):
    return torch.log(p.clamp_min(1e-12))


def _warp(logits, temperature, top_k):
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _exact_distribution(temperature, top_k, prompt=PROMPT):
    probs = _warp(_log(TARGET_PROBS), temperature, top_k)
    exact = {}
    for seq in itertools.product(range(4), repeat=NUM_TOKENS):
        p, prev = 1.0, prompt[0, -1].item()
        for y in seq:
            p *= probs[prev, y].item()
            prev = y
        exact[seq] = p
    return exact


class PastAcceptanceGate(DraftingGate):
    """Drafts only after a round that accepted an even number of tokens: a decision taken from
    past rounds (and so from tokens already emitted), as the real gate's is."""

    def __init__(self):
        super().__init__()
        self.last_tokens = 1

    def should_draft(self):
        return self.last_tokens % 2 == 1  # the previous round produced accepted + 1 tokens

    def record_drafted(self, tokens, seconds):
        self.last_tokens = tokens

    def record_plain(self, seconds, tokens=1):
        self.last_tokens = 1


def _chi_square_p_value(policy, temperature=1.0, top_k=None, seed=0, gate=False, prompt=PROMPT, draft_factory=None,
                        **generate_kwargs):
    """``draft_factory(target)`` replaces the default Markov draft (e.g. one with a reduced vocabulary)."""
    target = bigram_target(_log(TARGET_PROBS))
    if draft_factory is None:
        draft = markov_draft(target, _log(DRAFT_PROBS), block_size=3, confidence_logits=CONFIDENCE_LOGITS)
    else:
        draft = draft_factory(target)
    draft.generation_config.dspark_verify_policy = policy
    draft.generation_config.dspark_adaptive_drafting = gate
    torch.manual_seed(seed)
    counts, scheduled, sources = {}, [0] * 4, {}
    for _ in range(NUM_SAMPLES):
        out = target.generate(
            prompt, max_new_tokens=NUM_TOKENS + 3, do_sample=True, temperature=temperature, top_k=top_k,
            top_p=None, assistant_model=draft, **generate_kwargs,
        )
        seq = tuple(out[0, prompt.shape[1] : prompt.shape[1] + NUM_TOKENS].tolist())
        counts[seq] = counts.get(seq, 0) + 1
        for k, n in enumerate(draft.last_generation_stats.scheduled_length_histogram()):
            scheduled[k] += n
        for r in draft.last_generation_stats.rounds:
            sources[r.source] = sources.get(r.source, 0) + 1
    exact = _exact_distribution(temperature, top_k, prompt)
    chi2, cells = 0.0, 0
    for seq, p in exact.items():
        expected = NUM_SAMPLES * p
        if expected < 1e-9:
            assert seq not in counts, f"generated {seq}, which the target gives probability 0"
            continue
        chi2 += (counts.get(seq, 0) - expected) ** 2 / expected
        cells += 1
    dof = cells - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)).item()
    _chi_square_p_value.sources = sources  # rounds per draft source, for the context-lookup tests
    return p_value, scheduled


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, 3)])
def test_sampling_matches_target_distribution(temperature, top_k):
    p_value, scheduled = _chi_square_p_value(PrefixScheduler(SPS), temperature, top_k)
    assert all(n > 0 for n in scheduled), f"scheduler should admit every length 0..3, got {scheduled}"
    assert p_value > 1e-3, f"DSpark output deviates from the target distribution (p={p_value:.2e})"


def test_anticipating_scheduler_is_detected_as_biased():
    p_value, _ = _chi_square_p_value(AnticipatingScheduler(SPS))
    assert p_value < 1e-5, f"the test failed to detect the anticipating scheduler's bias (p={p_value:.2e})"


def test_sampling_lossless_when_a_gate_skips_drafting_from_past_rounds():
    p_value, scheduled = _chi_square_p_value(PrefixScheduler(SPS), gate=PastAcceptanceGate())
    assert p_value > 1e-3, f"DSpark output with a drafting gate deviates from the target (p={p_value:.2e})"


class SwingingLiveScheduler(PrefixScheduler):
    """A live scheduler whose cost model (the real :class:`StepCostModel` with windows of one: the
    latest observation replaces the estimate) is fed verify times that swing from round to round between
    a flat curve (verify much) and a steep one (verify little). The table changes during
    generation, driven by past rounds only, as the live cost model's is."""

    def __init__(self):
        super().__init__(cost_model=StepCostModel([1.0 / r for r in SPS], window=1, size_window=1, shrinkage=0.0))
        self.observed = 0
        self.tables_seen = set()

    def start_round(self, trace=None):
        self.tables_seen.add(self.sps)
        return super().start_round(trace)

    def observe_verify(self, num_tokens, seconds):
        self.observed += 1
        steep = self.observed % 3 == 0
        # Every size is reported each round, so the whole table swings (no size keeps a stale value).
        for size in range(1, len(SPS) + 1):
            synthetic = self.cost_model.prior(size) * (6.0 if steep and size > 1 else 0.3)
            super().observe_verify(size, synthetic)


def test_sampling_lossless_with_a_cost_model_that_changes_during_generation():
    policy = SwingingLiveScheduler()
    p_value, scheduled = _chi_square_p_value(policy)
    assert len(policy.tables_seen) > 2, "the cost model should change the scheduler's table during generation"
    assert all(n > 0 for n in scheduled), f"scheduler should admit every length 0..3, got {scheduled}"
    assert p_value > 1e-3, f"DSpark output with a changing cost model deviates from the target (p={p_value:.2e})"
