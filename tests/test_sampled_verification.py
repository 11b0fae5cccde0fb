"""Batch-1 sampled rounds are verified by dspark_hf's speculative sampling, one draw a round.

The rule itself is checked against its exact distribution (every accepted length and next token
enumerated), for a drafted proposal, a point-mass (lookup) proposal and a round without one; the
same samples against a wrong rule must fail, which shows the test's power. Whole generations go
through it without a single ``torch.multinomial`` call, and transformers' own assisted generation
outside DSpark calls keeps transformers' function and draws.
"""

import contextlib
import threading

import pytest
import torch

import dspark_hf  # noqa: F401  (installs the dispatch)
import transformers.generation.utils as generation_utils
from dspark_hf.decoding import verification
from dspark_hf.decoding.verification import (dspark_sampled_verification, hand_over_drafted,
                                             is_sampled_verification_installed, point_mass_logits,
                                             sampled_verification_active, verify_sampled_round)
from tiny_models import bigram_target, markov_draft

DRAWS = 12000
P = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])
Q = torch.tensor([[0.2, 0.5, 0.1, 0.1, 0.1], [0.1, 0.2, 0.3, 0.3, 0.1]])
PROPOSED = torch.tensor([1, 1])  # p/q = 0.4 at the first position, 3 at the second


def _logits(probs):
    return torch.log(probs.clamp_min(1e-30)).masked_fill(probs == 0, float("-inf"))


def _exact(p, q, proposed, residual_rule=True):
    """P(n kept, next token y) for a fixed proposal: keep position k with min(1, p/q), then draw
    from norm(max(0, p - q)) after a rejection (from p when ``residual_rule`` is False: wrong)."""
    exact, survive = {}, 1.0
    for k, x in enumerate(proposed.tolist()):
        keep = min(1.0, (p[k, x] / q[k, x]).item()) if q[k, x] > 0 else 1.0
        after = (p[k] - q[k]).clamp(min=0) if residual_rule else p[k]
        after = after / after.sum()
        for y in range(p.shape[1]):
            exact[(k, y)] = survive * (1 - keep) * after[y].item()
        survive *= keep
    for y in range(p.shape[1]):
        exact[(len(proposed), y)] = survive * p[len(proposed), y].item()
    return exact


def _counts(q_logits, proposed, p_logits, hand_over=None):
    """Draws per (kept, next token) cell; ``hand_over``: inside a DSpark call, makes the round's logits
    anew each round as the candidate generator does (a point mass, or drafted logits handed over with
    their exact q), which the verification recognises."""
    torch.manual_seed(0)
    ids = torch.cat([torch.tensor([[3, 4]]), proposed[None]], dim=1)
    counts = {}
    for _ in range(DRAWS):
        if hand_over is not None:
            q_logits = hand_over()
        valid, n = verify_sampled_round(ids, q_logits, proposed.numel(), p_logits)
        n = int(n)
        assert valid.shape == (1, n + 1) and valid[0, :n].tolist() == proposed[:n].tolist()
        counts[(n, int(valid[0, n]))] = counts.get((n, int(valid[0, n])), 0) + 1
    return counts


def _p_value(counts, exact):
    chi2, cells = 0.0, 0
    for cell, prob in exact.items():
        if prob < 1e-12:
            assert cell not in counts, f"drew {cell}, which has probability 0"
            continue
        chi2 += (counts.get(cell, 0) - DRAWS * prob) ** 2 / (DRAWS * prob)
        cells += 1
    return torch.special.gammaincc(torch.tensor((cells - 1) / 2.0), torch.tensor(chi2 / 2.0)).item()


@pytest.mark.parametrize("proposal", ["drafted", "drafted, in a DSpark call", "point mass",
                                      "point mass, in a DSpark call", "none"])
def test_verification_draws_the_exact_distribution_and_a_wrong_rule_is_detected(proposal, monkeypatch):
    in_call = proposal.endswith("call")
    rows = []  # speculative_accept's draft rows per round: None where the proposal counts as deterministic
    monkeypatch.setattr(verification, "speculative_accept",
                        lambda *a, _f=verification.speculative_accept: rows.append(a[4]) or _f(*a))
    hand_over = None
    if proposal.startswith("drafted"):
        q, q_logits, proposed = Q, _logits(Q)[None], PROPOSED
        if in_call:  # the logits handed over are off; q comes from the loop, so the result must follow Q
            wrong = _logits(Q.flip(-1))[None]
            # transformers may copy the logits (to the target's device): the verification matches the round by shape
            hand_over = lambda: hand_over_drafted(wrong, Q[None]).clone()  # noqa: E731
    elif proposal.startswith("point mass"):
        proposed = torch.tensor([0, 1])
        q_logits = point_mass_logits(proposed, P.shape[1])
        if in_call:
            hand_over = lambda: point_mass_logits(proposed, P.shape[1])  # noqa: E731
        q = torch.softmax(q_logits[0], -1)
        assert torch.equal(q, torch.nn.functional.one_hot(proposed, P.shape[1]).float())
    else:
        q, q_logits, proposed = Q[:0], torch.empty(1, 0, P.shape[1]), PROPOSED[:0]
    p = P[len(P) - proposed.numel() - 1:]
    with dspark_sampled_verification() if in_call else contextlib.nullcontext():
        counts = _counts(q_logits, proposed, _logits(p)[None], hand_over)
    # Inside a DSpark call a point mass skips the softmax of its one-hot rows; elsewhere it is drafted logits.
    deterministic = proposal == "none" or proposal == "point mass, in a DSpark call"
    assert all((r is None) == deterministic for r in rows) and len(rows) == DRAWS
    assert _p_value(counts, _exact(p, q, proposed)) > 1e-3
    if proposal != "none":  # with nothing proposed there is no residual to get wrong
        assert _p_value(counts, _exact(p, q, proposed, residual_rule=False)) < 1e-6


TARGET = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.7, 0.3, 0.0, 0.0], [0.1, 0.3, 0.3, 0.3], [0.6, 0.1, 0.1, 0.2]])
DRAFT = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.3, 0.3, 0.2, 0.2]])


def _count_multinomial(monkeypatch):
    calls = []
    original = torch.multinomial

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", counting)
    return calls


@pytest.mark.parametrize("lookup", [0, 3])
def test_sampled_dspark_generation_verifies_every_round_with_one_categorical_draw(monkeypatch, lookup):
    assert is_sampled_verification_installed()
    target = bigram_target(torch.log(TARGET.clamp_min(1e-12)))
    draft = markov_draft(target, torch.log(DRAFT.clamp_min(1e-12)), block_size=3)
    rounds = []
    monkeypatch.setattr(verification, "verify_sampled_round",
                        lambda *a, _f=verification.verify_sampled_round: rounds.append(a[2]) or _f(*a))
    deterministic = []  # proposals verified as deterministic (lookup copies recognised as point masses)
    monkeypatch.setattr(verification, "speculative_accept", lambda *a, _f=verification.speculative_accept:
                        deterministic.append(a[0].shape[1] > 0 and a[4] is None) or _f(*a))
    calls = _count_multinomial(monkeypatch)
    prompt = torch.tensor([[0, 1, 2, 3, 2, 0, 3, 1, 2]])
    torch.manual_seed(0)
    out = target.generate(prompt, max_new_tokens=24, do_sample=True, assistant_model=draft,
                          prompt_lookup_num_tokens=lookup)
    stats = draft.last_generation_stats
    assert calls == []  # the prefill's token and every round's are drawn by DSpark's verification
    assert len(rounds) == stats.num_rounds + 1 >= 6  # the rounds and the prefill
    kinds = {r.source for r in stats.rounds}
    assert out.shape[1] > prompt.shape[1] and ("lookup" in kinds) == (lookup > 0), kinds
    lookup_rounds = sum(r.source == "lookup" and r.verified > 0 for r in stats.rounds)
    assert sum(deterministic) == lookup_rounds and (lookup_rounds > 0) == (lookup > 0)


def test_transformers_assisted_generation_outside_dspark_keeps_its_own_verification(monkeypatch):
    target = bigram_target(torch.log(TARGET.clamp_min(1e-12)))
    prompt = torch.tensor([[0, 1, 2, 3, 2, 0, 3, 1, 2]])

    def lookup_generation():
        torch.manual_seed(1)
        return target.generate(prompt, max_new_tokens=24, do_sample=True, prompt_lookup_num_tokens=3)

    calls = _count_multinomial(monkeypatch)
    routed = lookup_generation()
    assert len(calls) > 1  # transformers draws every round itself
    monkeypatch.setattr(generation_utils, "_speculative_sampling",
                        generation_utils._speculative_sampling.__wrapped_original__)
    assert torch.equal(routed, lookup_generation())  # same draws, same tokens as without dspark_hf


def test_a_round_reads_only_what_it_was_handed():
    # q handed over for one round must not serve a later round that handed nothing over (begin_round,
    # called by the candidate generator): there the logits' own softmax is q.
    q_logits = _logits(Q)[None]
    ids = torch.cat([torch.tensor([[3, 4]]), PROPOSED[None]], dim=1)
    p_logits = _logits(P)[None]
    seen = []
    original = verification.speculative_accept

    def recording(*args):
        seen.append(args[5])
        return original(*args)

    with dspark_sampled_verification(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(verification, "speculative_accept", recording)
        hand_over_drafted(q_logits, torch.softmax(q_logits, -1))
        verification.begin_round()
        verify_sampled_round(ids, q_logits, 2, p_logits)
        hand_over_drafted(q_logits, torch.softmax(q_logits, -1))
        verify_sampled_round(ids, q_logits, 2, p_logits)
    assert seen[0] is None and seen[1] is not None


def test_the_dspark_mark_belongs_to_the_call_and_its_thread():
    assert not sampled_verification_active()
    seen = []
    with dspark_sampled_verification():
        assert sampled_verification_active()
        thread = threading.Thread(target=lambda: seen.append(sampled_verification_active()))
        thread.start()
        thread.join()
    assert seen == [False] and not sampled_verification_active()


def test_without_the_routing_sampled_rounds_fall_back_to_transformers_verification(monkeypatch):
    # As on a transformers whose _speculative_sampling has another signature: lookup copies still go as
    # point masses (which transformers' function verifies correctly) and plain steps without logits.
    monkeypatch.setattr(generation_utils, "_speculative_sampling",
                        generation_utils._speculative_sampling.__wrapped_original__)
    assert not is_sampled_verification_installed()
    target = bigram_target(torch.log(TARGET.clamp_min(1e-12)))
    draft = markov_draft(target, torch.log(DRAFT.clamp_min(1e-12)), block_size=3)
    calls = _count_multinomial(monkeypatch)
    torch.manual_seed(0)
    out = target.generate(torch.tensor([[0, 1, 2, 3, 2, 0, 3, 1, 2]]), max_new_tokens=24, do_sample=True,
                          assistant_model=draft, prompt_lookup_num_tokens=3)
    assert out.shape[1] > 9 and len(calls) > draft.last_generation_stats.num_rounds // 2


def test_an_unexpected_signature_is_left_alone_and_logged(monkeypatch, caplog):
    def _speculative_sampling(candidates, logits, new_logits):  # another transformers' shape of it
        raise AssertionError("not called here")

    monkeypatch.setattr(generation_utils, "_speculative_sampling", _speculative_sampling)
    with caplog.at_level("WARNING"):
        verification.install_sampled_verification()
    assert generation_utils._speculative_sampling is _speculative_sampling
    assert "unexpected signature" in caplog.text
