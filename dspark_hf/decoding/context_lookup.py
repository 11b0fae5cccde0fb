"""Context lookup: a second draft source that copies from the prompt and the generated text.

Small models copy a lot: they restate the question, the options, the code they were given, and
their own phrases. A learned draft misses much of that; an n-gram lookup catches it for free
(transformers ships it as prompt lookup decoding). DSpark generation offers both, and chooses per
round by expected tokens per second, the scheduler's currency:

* the lookup proposal: the continuation of the most recent earlier occurrence of the longest
  suffix n-gram (``n = max_ngram .. 1``) of the sequence, up to ``max_tokens`` tokens. Its
  acceptance is estimated online, per match length, from the lookup rounds of the same call (a
  Beta prior, counts of accepted and rejected positions). With the scheduler's step-rate table
  this gives the best proposal length ``l`` and its value ``Theta_lookup = SPS(1 + l) * E[accepted + 1]``;
* the DSpark block: its value is what recent DSpark rounds delivered: tokens per round over the
  round's cost, the table's step time for the tokens it verified scaled by the measured ratio of
  the whole round (draft forward and serial loop included) to its verify forward. Both values are
  thus in the table's units, which a user-given table need not share with the wall clock.

When lookup's value is the higher, the round verifies the lookup tokens and skips the draft
forward. Until DSpark has a few rounds of history, and every ``probe_every`` rounds after, DSpark
runs anyway so that its value stays current.

Lossless: the proposal and the choice read only the sequence so far and earlier rounds, never a
token being verified. A lookup proposal is a deterministic draft (``q`` one-hot); transformers
verifies it by sampling the target at each position and keeping the tokens while they match, which
is speculative sampling with ``q`` one-hot (greedy: identical output).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

__all__ = ["ContextLookup", "LookupProposal", "SourceChooser"]


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
        prior_acceptance, prior_weight: Beta prior of the per-position acceptance of a proposal.
    """

    def __init__(self, max_tokens: int = 10, max_ngram: int = 3, search_window: int = 4096,
                 prior_acceptance: float = 0.5, prior_weight: float = 2.0) -> None:
        if max_tokens < 1 or max_ngram < 1 or search_window < 2:
            raise ValueError(
                f"Context lookup needs max_tokens >= 1, max_ngram >= 1 and search_window >= 2; got "
                f"{max_tokens}, {max_ngram}, {search_window} (prompt_lookup_num_tokens, max_matching_ngram_size)."
            )
        if not (0.0 < prior_acceptance < 1.0) or prior_weight <= 0:
            raise ValueError(f"prior_acceptance must be in (0, 1) and prior_weight > 0, got {prior_acceptance}, {prior_weight}.")
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.search_window = search_window
        self._prior = (prior_acceptance * prior_weight, (1.0 - prior_acceptance) * prior_weight)
        self._accepted = [0] * (max_ngram + 1)  # per match length
        self._rejected = [0] * (max_ngram + 1)

    def propose(self, sequence: torch.LongTensor, limit: int) -> LookupProposal | None:
        """The proposal for a 1-D ``sequence`` (at most ``limit`` tokens), or None without a match."""
        limit = min(limit, self.max_tokens)
        if limit < 1:
            return None
        window = sequence[-self.search_window:]
        length = window.shape[0]
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            # Every earlier n-gram that ends before the last token, compared with the suffix at once.
            grams = window[:-1].unfold(0, n, 1)
            hits = (grams == window[-n:]).all(dim=1).nonzero()
            if hits.numel() == 0:
                continue
            start = int(hits[-1]) + n  # the most recent occurrence: recent text is copied most
            tokens = window[start : start + limit]
            if tokens.numel():
                return LookupProposal(tokens=tokens, ngram=n)
        return None

    def acceptance(self, ngram: int) -> float:
        """Estimated probability that a position is accepted given the previous ones were."""
        a, b = self._prior
        return (self._accepted[ngram] + a) / (self._accepted[ngram] + self._rejected[ngram] + a + b)

    def record(self, ngram: int, verified: int, accepted: int) -> None:
        """A lookup round verified ``verified`` tokens of a proposal and accepted ``accepted``."""
        self._accepted[ngram] += accepted
        self._rejected[ngram] += int(accepted < verified)


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
        min_rounds: DSpark rounds observed before lookup may replace it.
        probe_every: while lookup keeps winning, run DSpark once in this many rounds.
    """

    def __init__(self, lookup: ContextLookup, window: int = 16, min_rounds: int = 4, probe_every: int = 16) -> None:
        self.lookup = lookup
        self.min_rounds = min_rounds
        self.probe_every = probe_every
        self._dspark: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, cost in table seconds)
        self._since_dspark = 0

    def dspark_rate(self) -> float | None:
        """Tokens per (table) second of recent DSpark rounds (None before ``min_rounds`` of them)."""
        if len(self._dspark) < self.min_rounds:
            return None
        return sum(t for t, _ in self._dspark) / max(sum(s for _, s in self._dspark), 1e-12)

    def choose(self, proposal: LookupProposal | None, sps: tuple[float, ...]) -> int:
        """How many lookup tokens to verify this round (0: run DSpark instead)."""
        dspark = self.dspark_rate()
        if proposal is None or dspark is None or self._since_dspark + 1 >= self.probe_every:
            return 0
        length, theta = expected_value(self.lookup.acceptance(proposal.ngram), sps, proposal.tokens.numel())
        return length if length > 0 and theta > dspark else 0

    def record_dspark(self, tokens: int, verified: int, round_over_verify: float, sps: tuple[float, ...]) -> None:
        """A DSpark round (or a plain step the drafting gate chose) produced ``tokens`` with a
        verify forward of ``verified + 1`` tokens, the whole round taking ``round_over_verify``
        times as long as that forward."""
        self._dspark.append((tokens, round_over_verify / _rate(sps, verified + 1)))
        self._since_dspark = 0

    def record_lookup(self, proposal: LookupProposal, verified: int, accepted: int) -> None:
        self.lookup.record(proposal.ngram, verified, accepted)
        self._since_dspark += 1
