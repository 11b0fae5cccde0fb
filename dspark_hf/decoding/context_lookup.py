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
  HumanEval rounds.) Its acceptance is estimated online from the lookup rounds of the same call (a
  Beta prior, counts of accepted and rejected positions), per match length and per state: a copy in progress (the
  previous round verified a lookup proposal and accepted all of it) is far likelier to go on than
  a fresh match, and pooling the two made the estimate too low inside long copies and too high
  outside them. With the scheduler's step-rate table this gives the best proposal length ``l`` and
  its value ``Theta_lookup = SPS(1 + l) * E[accepted + 1]``;
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
        prior_acceptance, prior_weight: Beta prior of the per-position acceptance of a fresh match.
        continuing_prior_acceptance: the prior's mean for a match that continues a fully accepted copy.
    """

    def __init__(self, max_tokens: int = 10, max_ngram: int = 3, search_window: int = 4096, max_context: int = 64,
                 prior_acceptance: float = 0.5, prior_weight: float = 2.0,
                 continuing_prior_acceptance: float = 0.8) -> None:
        if max_tokens < 1 or max_ngram < 1 or search_window < 2 or max_context < 1:
            raise ValueError(
                f"Context lookup needs max_tokens >= 1, max_ngram >= 1, search_window >= 2 and max_context >= 1; got "
                f"{max_tokens}, {max_ngram}, {search_window}, {max_context} (prompt_lookup_num_tokens, "
                "max_matching_ngram_size)."
            )
        if not (0.0 < prior_acceptance < 1.0 and 0.0 < continuing_prior_acceptance < 1.0) or prior_weight <= 0:
            raise ValueError("prior_acceptance and continuing_prior_acceptance must be in (0, 1) and prior_weight > 0, "
                             f"got {prior_acceptance}, {continuing_prior_acceptance}, {prior_weight}.")
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.search_window = search_window
        self.max_context = max_context
        self._prior = [(mean * prior_weight, (1.0 - mean) * prior_weight)  # [continuing]
                       for mean in (prior_acceptance, continuing_prior_acceptance)]
        # Counts per (copy in progress, match length): [continuing][ngram].
        self._accepted = [[0] * (max_ngram + 1) for _ in range(2)]
        self._rejected = [[0] * (max_ngram + 1) for _ in range(2)]

    def propose(self, sequence: torch.LongTensor, limit: int) -> LookupProposal | None:
        """The proposal for a 1-D ``sequence`` (at most ``limit`` tokens), or None without a match."""
        limit = min(limit, self.max_tokens)
        if limit < 1:
            return None
        window = sequence[-self.search_window:]
        # The search runs on the host in numpy: a few small array ops per n-gram length, several
        # times cheaper per round than the same ops as torch calls (benchmarks/lookup_match_cost.py).
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

    def acceptance(self, ngram: int, continuing: bool = False) -> float:
        """Estimated probability that a position is accepted given the previous ones were, for a
        match of ``ngram`` tokens that continues a fully accepted copy (``continuing``) or not."""
        a, b = self._prior[continuing]
        accepted, rejected = self._accepted[continuing][ngram], self._rejected[continuing][ngram]
        return (accepted + a) / (accepted + rejected + a + b)

    def record(self, ngram: int, verified: int, accepted: int, continuing: bool = False) -> None:
        """A lookup round verified ``verified`` tokens of a proposal and accepted ``accepted``."""
        self._accepted[continuing][ngram] += accepted
        self._rejected[continuing][ngram] += int(accepted < verified)


def _rate(sps: tuple[float, ...], num_tokens: int) -> float:
    return sps[num_tokens - 1] if num_tokens <= len(sps) else sps[-1] * len(sps) / num_tokens


def expected_value(acceptance: float, sps: tuple[float, ...], max_length: int) -> tuple[int, float]:
    """Best verification length ``l <= max_length`` for a constant per-position acceptance and its
    ``Theta = SPS(1 + l) * (1 + a + a^2 + ... + a^l)`` (beyond the table, time grows linearly)."""
    best_length, best_theta = 0, sps[0]
    expected, survival = 1.0, 1.0
    for length in range(1, max_length + 1):
        survival *= acceptance
        expected += survival
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

    def acceptance(self, proposal: LookupProposal) -> float:
        """The estimated per-position acceptance of ``proposal`` in this round's state."""
        return self.lookup.acceptance(proposal.ngram, self.copying)

    def choose(self, proposal: LookupProposal | None, sps: tuple[float, ...]) -> int:
        """How many lookup tokens to verify this round (0: run DSpark instead)."""
        if proposal is None or self._since_dspark + 1 >= self.probe_every:
            return 0
        length, theta = expected_value(self.acceptance(proposal), sps, proposal.tokens.numel())
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
