"""Context lookup: a second draft source that copies from the prompt and the generated text.

Small models copy a lot: they restate the question, the options, the code they were given, and
their own phrases. A learned draft misses much of that; an n-gram lookup catches it for free
(transformers ships it as prompt lookup decoding). DSpark generation offers both, and chooses per
round by expected tokens per second, the scheduler's currency:

* the lookup proposal: the continuation of an earlier occurrence of the longest suffix n-gram
  (``n = max_ngram .. 1``) of the sequence, up to ``max_tokens`` tokens. Of several occurrences,
  the one whose match reaches furthest back wins (ties: the most recent): a copy in progress
  then keeps reading from its source, while a phrase the text keeps repeating is read from its
  latest use. (On the shipped bench sets, always taking the earliest occurrence, as transformers'
  prompt lookup does, cost GSM8K and MT-Bench rounds; always the most recent cost copy-heavy and
  HumanEval rounds.) Its acceptance is estimated online from the lookup rounds of the same call
  (Beta priors, counts of accepted and rejected positions) as two numbers: the chance that the
  copy's *first* token is accepted, and the chance that each later one is, given the ones before
  were. A copy either is the text's continuation, and then tends to run for many tokens, or is
  not, and then usually fails at once. One rate for every position made a long copy look as
  doubtful as its first token, so fresh matches were verified one token at a time where a
  second token costs much more than the first (measured: docs/performance.md). Both numbers are kept per match length and per
  state: a copy in progress (the previous round verified a lookup proposal and accepted all of
  it) is far likelier to go on than a fresh match. With the scheduler's step-rate table this
  gives the best proposal length ``l`` and its value ``Theta_lookup = SPS(1 + l) * E[accepted + 1]``,
  where ``E[accepted] = first * (1 + follow + ... + follow^(l-1))``;
* the DSpark block: its value is what recent DSpark rounds delivered: tokens per round over the
  round's cost, the table's step time for the tokens it verified scaled by the measured ratio of
  the whole round (draft forward and serial loop included) to its verify forward. Both values are
  thus in the table's units, which a user-given table need not share with the wall clock. Until
  ``min_rounds`` DSpark rounds are seen, the missing ones count as prior rounds of
  ``PRIOR_DSPARK_TOKENS`` tokens at the cost of a plain step, so a copy can win from the first round
  (before, the first rounds always drafted, which is where copy-heavy prompts lost to plain lookup).

When lookup's value is the higher, the round verifies the lookup tokens and skips the draft
forward. Every ``probe_every`` rounds DSpark runs anyway so that its value stays current.

Lossless: the proposal and the choice read only the sequence so far and earlier rounds, never a
token being verified. A lookup proposal is a deterministic draft (``q`` one-hot); transformers
verifies it by sampling the target at each position and keeping the tokens while they match, which
is speculative sampling with ``q`` one-hot (greedy: identical output).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ContextLookup", "LookupProposal", "PRIOR_DSPARK_TOKENS", "SourceChooser"]

# Tokens a DSpark round is assumed to deliver, at the cost of one plain target step, before the call
# has measured any: about what a trained draft gives on chat (the shipped SmolLM2 draft measures
# 1.3-2.1 tokens per round at 1.1-1.3 plain steps per round).
PRIOR_DSPARK_TOKENS = 1.5


@dataclass
class LookupProposal:
    """Tokens copied from the context after an earlier occurrence of the sequence's last ``ngram`` tokens."""

    tokens: torch.LongTensor  # (length,)
    ngram: int


class ContextLookup:
    """Finds lookup proposals and estimates their acceptance from earlier lookup rounds.

    Args:
        max_tokens: longest proposal (transformers' ``prompt_lookup_num_tokens``).
        max_ngram: longest suffix n-gram searched (transformers' ``max_matching_ngram_size``).
        search_window: only the last this many tokens are searched (bounds the per-round cost).
        max_context: how far back a match is followed when ranking occurrences.
        prior_acceptance, prior_weight: Beta prior of the acceptance of a fresh match's first token.
        continuing_prior_acceptance: the prior's mean for the first token of a match that continues
            a fully accepted copy.
        follow_prior_acceptance: the prior's mean for each later token of a copy, given the ones
            before it were accepted.
    """

    def __init__(self, max_tokens: int = 10, max_ngram: int = 3, search_window: int = 4096, max_context: int = 64,
                 prior_acceptance: float = 0.5, prior_weight: float = 2.0,
                 continuing_prior_acceptance: float = 0.8, follow_prior_acceptance: float = 0.8) -> None:
        if max_tokens < 1 or max_ngram < 1 or search_window < 2 or max_context < 1:
            raise ValueError(
                f"Context lookup needs max_tokens >= 1, max_ngram >= 1, search_window >= 2 and max_context >= 1; got "
                f"{max_tokens}, {max_ngram}, {search_window}, {max_context} (prompt_lookup_num_tokens, "
                "max_matching_ngram_size)."
            )
        means = (prior_acceptance, continuing_prior_acceptance, follow_prior_acceptance)
        if not all(0.0 < mean < 1.0 for mean in means) or prior_weight <= 0:
            raise ValueError("prior_acceptance, continuing_prior_acceptance and follow_prior_acceptance must be in "
                             f"(0, 1) and prior_weight > 0, got {', '.join(map(str, means))} and {prior_weight}.")
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.search_window = search_window
        self.max_context = max_context
        # Beta priors (accepted, rejected pseudo-counts): [first token of a fresh / continuing match, later tokens].
        self._prior = [(mean * prior_weight, (1.0 - mean) * prior_weight) for mean in means]
        # Counts per (copy in progress, match length): [continuing][ngram] = [first ok, first no, later ok, later no].
        self._counts = [[[0, 0, 0, 0] for _ in range(max_ngram + 1)] for _ in range(2)]

    def propose(self, sequence: torch.LongTensor, limit: int) -> LookupProposal | None:
        """The proposal for a 1-D ``sequence`` (at most ``limit`` tokens), or None without a match."""
        limit = min(limit, self.max_tokens)
        if limit < 1:
            return None
        window = sequence[-self.search_window:]
        # The search runs on the host in numpy: a few small array ops per n-gram length, cheaper
        # per round than the same ops as torch calls (benchmarks/lookup_match_cost.py).
        ids = window.detach().cpu().numpy()
        length = ids.shape[0]
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            # Every earlier n-gram that ends before the last token, compared with the suffix at once.
            found = np.ones(length - n, dtype=bool)
            for k in range(n):
                found &= ids[k : length - n + k] == ids[length - n + k]
            hits = np.flatnonzero(found)
            if hits.size == 0:
                continue
            start = self._best_occurrence(ids, hits + n - 1) + 1
            tokens = window[start : start + limit]
            if tokens.numel():
                return LookupProposal(tokens=tokens, ngram=n)
        return None

    def _best_occurrence(self, ids: np.ndarray, ends: np.ndarray) -> int:
        """Of the occurrences ending at ``ends`` (ascending), the end of the one whose match with the
        end of ``ids`` reaches furthest back (the latest of equals)."""
        if ends.size == 1:
            return int(ends[0])
        depth = min(self.max_context, int(ends[-1]) + 1)
        back = np.arange(depth)
        earlier = ends[:, None] - back  # (occurrences, depth): positions read backwards from each end
        matches = (ids[np.maximum(earlier, 0)] == ids[ids.shape[0] - 1 - back]) & (earlier >= 0)
        reach = np.cumprod(matches, axis=1).sum(axis=1)
        return int(ends[reach.size - 1 - int(np.argmax(reach[::-1]))])

    def acceptances(self, ngram: int, continuing: bool = False) -> tuple[float, float]:
        """Estimated ``(first, follow)`` for a match of ``ngram`` tokens that continues a fully
        accepted copy (``continuing``) or not: the probability that the proposal's first token is
        accepted, and that each later one is, given the ones before it were."""
        first_ok, first_no, later_ok, later_no = self._counts[continuing][ngram]
        (a, b), (c, d) = self._prior[continuing], self._prior[2]
        return (first_ok + a) / (first_ok + first_no + a + b), (later_ok + c) / (later_ok + later_no + c + d)

    def record(self, ngram: int, verified: int, accepted: int, continuing: bool = False) -> None:
        """A lookup round verified ``verified`` tokens of a proposal and accepted ``accepted``."""
        if verified < 1:
            return
        counts = self._counts[continuing][ngram]
        counts[0 if accepted else 1] += 1
        if accepted:
            counts[2] += accepted - 1
            counts[3] += int(accepted < verified)


def _rate(sps: tuple[float, ...], num_tokens: int) -> float:
    return sps[num_tokens - 1] if num_tokens <= len(sps) else sps[-1] * len(sps) / num_tokens


def expected_value(first: float, follow: float, sps: tuple[float, ...], max_length: int) -> tuple[int, float]:
    """Best verification length ``l <= max_length`` for a copy whose first token is accepted with
    probability ``first`` and each later one with ``follow`` (given the ones before), and its
    ``Theta = SPS(1 + l) * (1 + first * (1 + follow + ... + follow^(l-1)))`` (beyond the table,
    time grows linearly)."""
    best_length, best_theta = 0, sps[0]
    expected, survival = 1.0, first
    for length in range(1, max_length + 1):
        expected += survival
        survival *= follow
        theta = _rate(sps, length + 1) * expected
        if theta > best_theta:
            best_length, best_theta = length, theta
    return best_length, best_theta


class SourceChooser:
    """Per call: which source each round verifies, from past rounds and the lookup proposal only.

    Args:
        lookup: the call's :class:`ContextLookup`.
        window: recent DSpark rounds whose delivered tokens per unit of cost stand for DSpark's value.
        min_rounds: DSpark rounds below which prior rounds (``PRIOR_DSPARK_TOKENS`` tokens at the
            cost of a plain step) fill in DSpark's value.
        probe_every: while lookup keeps winning, run DSpark once in this many rounds.
    """

    def __init__(self, lookup: ContextLookup, window: int = 16, min_rounds: int = 4, probe_every: int = 16) -> None:
        self.lookup = lookup
        self.min_rounds = min_rounds
        self.probe_every = probe_every
        self._dspark: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, cost in table seconds)
        self._since_dspark = 0
        self.copying = False  # the last round verified a lookup copy and accepted all of it

    def dspark_rate(self, sps: tuple[float, ...]) -> float:
        """Tokens per (table) second of recent DSpark rounds, with prior rounds standing in for
        those missing below ``min_rounds``."""
        missing = max(self.min_rounds - len(self._dspark), 0)
        tokens = sum(t for t, _ in self._dspark) + missing * PRIOR_DSPARK_TOKENS
        cost = sum(s for _, s in self._dspark) + missing / sps[0]
        return tokens / max(cost, 1e-12)

    def confidences(self, proposal: LookupProposal, length: int) -> list[float]:
        """The estimated acceptance of each of ``proposal``'s first ``length`` tokens in this round's
        state, given the ones before it were accepted (what a policy's ``c_1..c_length`` mean)."""
        first, follow = self.lookup.acceptances(proposal.ngram, self.copying)
        return [first] + [follow] * (length - 1)

    def choose(self, proposal: LookupProposal | None, sps: tuple[float, ...]) -> int:
        """How many lookup tokens to verify this round (0: run DSpark instead)."""
        if proposal is None or self._since_dspark + 1 >= self.probe_every:
            return 0
        first, follow = self.lookup.acceptances(proposal.ngram, self.copying)
        length, theta = expected_value(first, follow, sps, proposal.tokens.numel())
        return length if length > 0 and theta > self.dspark_rate(sps) else 0

    def record_dspark(self, tokens: int, verified: int, round_over_verify: float, sps: tuple[float, ...]) -> None:
        """A DSpark round (or a plain step the drafting gate chose) produced ``tokens`` with a
        verify forward of ``verified + 1`` tokens, the whole round taking ``round_over_verify``
        times as long as that forward."""
        self._dspark.append((tokens, round_over_verify / _rate(sps, verified + 1)))
        self._since_dspark = 0
        self.copying = False

    def record_lookup(self, proposal: LookupProposal, verified: int, accepted: int) -> None:
        self.lookup.record(proposal.ngram, verified, accepted, self.copying)
        self._since_dspark += 1
        self.copying = 0 < verified == accepted
