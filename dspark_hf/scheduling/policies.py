"""Verification-length policies: how many of a round's draft tokens the target verifies.

A DSpark round drafts ``gamma`` tokens together with per-position confidences
``c_1..c_gamma`` (``c_k`` = probability that draft position ``k`` is accepted given that
positions ``1..k-1`` were). A *verification policy* decides how many leading draft tokens the
target model verifies this round:

* :class:`PrefixScheduler`: the hardware-aware prefix scheduler of the DSpark paper
  (section 3.2.2, Algorithm 1). It maximises the expected token throughput
  ``Theta = E[accepted tokens] * SPS(B)`` along a greedy admission path, with an early stop
  that keeps speculative decoding lossless.
* :class:`FixedLengthPolicy`: always verify a fixed number of draft tokens (plain DFlash).
* :class:`ThresholdPolicy`: the static threshold on prefix survival ``c_1 * ... * c_k`` used by
  earlier work.
* :class:`PerPositionThresholdPolicy`: DeepSpec's ``--confidence-threshold`` rule, a threshold on
  each position's own confidence ``c_k`` (cut at the first position below it).
* :class:`VerifyPolicy`: the interface; subclass it for a policy of your own.

``SPS(B)`` is the target engine's steps per second when one forward pass processes ``B`` tokens;
:mod:`dspark_hf.scheduling.step_rates` measures it and keeps the live cost model the default scheduler reads.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .cost_model import StepCostModel
from .shared_cost import shared_cost_model
from .step_rates import profile_sps

__all__ = [
    "VerifyPolicy",
    "PrefixScheduler",
    "FixedLengthPolicy",
    "ThresholdPolicy",
    "PerPositionThresholdPolicy",
    "offer_until_refused",
    "checked_admission",
    "lookup_step_rates",
]


def _as_float_list(values: Sequence[float]) -> list[float]:
    """Returns ``values`` as a list of Python floats (accepts lists, tuples and 1-D tensors)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


def _rate_from_table(table: Sequence[float], num_tokens: int) -> float:
    """``SPS(B)`` from a table, with time growing linearly in ``B`` beyond its end."""
    if num_tokens <= len(table):
        return table[num_tokens - 1]
    return table[-1] * len(table) / num_tokens


def _check_confidence(value: float, position: int) -> None:
    # Written so that NaN fails too (every comparison with NaN is False).
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"Confidence at draft position {position} is {value!r}; confidences must be "
            "probabilities in [0, 1]. Pass the sigmoid outputs of the confidence head."
        )


def checked_admission(policy: Any, admitted: Any, offered: int, method: str = "admit") -> int:
    """``admitted``, a policy's verification length for ``offered`` positions, as an int in
    ``0..offered``; a ``ValueError`` naming the policy and the value otherwise (a float, a bool,
    a negative or too long length would break slicing or corrupt the round statistics)."""
    try:
        length = None if isinstance(admitted, bool) else operator.index(admitted)
    except TypeError:
        length = None
    if length is None or not 0 <= length <= offered:
        raise ValueError(
            f"{type(policy).__name__}.{method} returned {admitted!r} for {offered} offered draft position(s); a "
            f"verification length must be an integer from 0 to {offered} (the number of confidences it was given)."
        )
    return length


def offer_until_refused(offer: Callable[[float], bool], confidences: Iterable[float], *, validate: bool = True,
                        offered: list[float] | None = None) -> int:
    """Offers ``c_1, c_2, ...`` to a round's ``offer`` (see :meth:`VerifyPolicy.start_round`) in
    order, stopping at the first refusal; returns how many positions were admitted.

    Args:
        offer: the round's decision function.
        confidences: the confidences to offer, in position order (Python floats).
        validate: raise ``ValueError`` for a confidence outside ``[0, 1]`` (NaN included). Without
            it a NaN is offered as it is, and every built-in policy refuses it.
        offered: when given, receives every confidence offered, the refused one included.
    """
    admitted = 0
    for position, confidence in enumerate(confidences, start=1):
        if validate:
            _check_confidence(confidence, position)
        if offered is not None:
            offered.append(confidence)
        if not offer(confidence):
            break
        admitted = position
    return admitted


class VerifyPolicy:
    """Interface of a verification-length policy.

    Attributes:
        requires_confidences: whether the policy looks at the confidence values. When it is
            ``False`` the caller may skip computing confidences and pass any sequence of the right
            length (only ``len(confidences)`` is used).

    Single-request policies implement :meth:`start_round`, the incremental form: the caller offers
    ``c_1, c_2, ...`` one at a time and stops at the first refusal. That form lets the serial
    sampling loop stop as soon as the policy does (no Markov bias or logits processors for
    positions that will not be verified), and it makes every policy non-anticipating by
    construction: admitting position ``k`` can only depend on ``c_1..c_k``. :meth:`admit` runs
    the same decision over a whole list; :meth:`admit_batch` defaults to deciding every request
    on its own.
    """

    requires_confidences: bool = True

    def start_round(self, trace: list[float] | None = None) -> Callable[[float], bool]:
        """Starts one round's decision and returns ``offer``: ``offer(c_k)`` for ``k = 1, 2, ...``
        says whether position ``k`` is verified; after the first ``False`` it is not called again.

        ``trace``, when given, receives the policy's internal scores (see
        :meth:`PrefixScheduler.throughputs`)."""
        raise NotImplementedError

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        """Called after each verify forward of ``num_tokens`` tokens that took ``seconds``
        (a cost-model hook; the default ignores it)."""

    def admit(self, confidences: Sequence[float]) -> int:
        """Decides the verification length of one request.

        Args:
            confidences: ``c_1..c_n`` for the draft positions available this round (``n`` is
                ``gamma``, or fewer near the generation length budget).

        Returns:
            How many leading draft tokens to verify, in ``0..len(confidences)``.
        """
        return offer_until_refused(self.start_round(), _as_float_list(confidences))

    def admit_batch(self, confidences_per_request: Sequence[Sequence[float]], *, min_width: int = 1) -> list[int]:
        """Decides the verification lengths of ``R`` requests decoded together.

        Args:
            confidences_per_request: one confidence sequence per request (lengths may differ).
            min_width: tokens per row the batched verify forward has anyway (``1 +`` the longest
                proposal already fixed this round, e.g. a context-lookup copy): the forward is
                ``R x width`` tokens, padding included. Policies that do not weigh cost ignore it.

        Returns:
            One verification length per request, each in ``0..len(confidences_per_request[r])``.
        """
        return [self.admit(confidences) for confidences in confidences_per_request]


class FixedLengthPolicy(VerifyPolicy):
    """Verifies a fixed number of draft tokens, ``min(length, len(confidences))``.

    This is the DFlash behaviour (``length = gamma``) and does not look at the confidences.
    """

    requires_confidences = False

    def __init__(self, length: int) -> None:
        try:
            length = operator.index(length)
        except TypeError:
            raise ValueError(
                f"FixedLengthPolicy length must be an integer, got {length!r}; pass the number of "
                "draft tokens to verify each round (e.g. gamma)."
            ) from None
        if length < 0:
            raise ValueError(
                f"FixedLengthPolicy length must be >= 0, got {length}; pass the number of draft "
                "tokens to verify each round (0 disables speculation, gamma verifies all)."
            )
        self.length = length

    def start_round(self, trace: list[float] | None = None) -> Callable[[float], bool]:
        offered = 0

        def offer(confidence: float) -> bool:
            nonlocal offered
            offered += 1
            return offered <= self.length

        return offer

    def admit(self, confidences: Sequence[float]) -> int:
        return min(self.length, len(confidences))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self.length})"


class _ConfidenceThresholdPolicy(VerifyPolicy):
    """What the two threshold policies share: each position gets a score from ``c_1..c_k``, and
    the round admits positions up to the first score below ``threshold``. The scan stops there,
    so admitting position ``k`` depends on ``c_1..c_k`` only (non-anticipating, like the prefix
    scheduler). Subclasses set how the score is formed and the threshold's range and meaning."""

    requires_confidences = True
    scores_prefix_survival: bool  # score = c_1 * ... * c_k (True) or c_k alone (False)
    zero_threshold_allowed: bool
    threshold_meaning: str  # completes the error message for a threshold out of range

    def __init__(self, threshold: float) -> None:
        threshold = float(threshold)
        low_ok = threshold >= 0.0 if self.zero_threshold_allowed else threshold > 0.0
        if not (low_ok and threshold <= 1.0):  # NaN fails both comparisons
            interval = "[0, 1]" if self.zero_threshold_allowed else "(0, 1]"
            raise ValueError(
                f"{type(self).__name__} threshold must be in {interval}, got {threshold!r}; it is "
                f"{self.threshold_meaning} (e.g. 0.5)."
            )
        self.threshold = threshold

    def start_round(self, trace: list[float] | None = None) -> Callable[[float], bool]:
        score = 1.0

        def offer(confidence: float) -> bool:
            nonlocal score
            score = score * confidence if self.scores_prefix_survival else confidence
            if trace is not None:
                trace.append(score)
            return score >= self.threshold  # `>=` is False on NaN

        return offer

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self.threshold})"


class ThresholdPolicy(_ConfidenceThresholdPolicy):
    """Static threshold on prefix survival: verifies the longest prefix with
    ``c_1 * ... * c_k >= threshold``, a threshold in ``(0, 1]``.

    The scan stops at the first position that fails the threshold, so whether position ``k`` is
    admitted depends on ``c_1..c_k`` only (non-anticipating, like the prefix scheduler).
    """

    scores_prefix_survival = True
    zero_threshold_allowed = False
    threshold_meaning = "a probability that the whole prefix is accepted"


class PerPositionThresholdPolicy(_ConfidenceThresholdPolicy):
    """DeepSpec's ``--confidence-threshold`` rule: verifies draft positions up to the first one
    whose own confidence is below ``threshold`` (in ``[0, 1]``), i.e. the longest prefix with
    ``c_j >= threshold`` for every ``j <= k``.

    Unlike :class:`ThresholdPolicy`, which thresholds the running product ``c_1 * ... * c_k``
    (the probability that the whole prefix survives), each position is judged on its own
    confidence: ``[0.7] * 5`` at ``threshold=0.5`` verifies 5 tokens here and 1 there. Use this one
    to reproduce DeepSpec's published threshold settings. Admitting position ``k`` depends on
    ``c_1..c_k`` only, so it is non-anticipating (lossless).
    """

    scores_prefix_survival = False
    zero_threshold_allowed = True
    threshold_meaning = "the lowest confidence a draft position may have and still be verified"


class PrefixScheduler(VerifyPolicy):
    """The hardware-aware prefix scheduler (DSpark paper, Algorithm 1).

    Args:
        sps: the profiled step-rate table; ``sps[B - 1]`` is the number of target forward steps
            per second when one forward processes ``B`` tokens. It must be non-empty, finite,
            positive and non-increasing (:func:`profile_sps` returns such a table).
        live: treat ``sps`` as a prior that the verify times of the rounds correct (a
            :class:`~dspark_hf.scheduling.cost_model.StepCostModel` built from it).
        cost_model: a (shared) live cost model instead of ``sps``; the default scheduler uses one
            per target and process.
        max_tokens: length of the table read from a cost model (default: its profiled length).

    With a live cost model the table is read once at the start of each round (in
    :meth:`start_round` / :meth:`admit_batch`), and only holds times of earlier rounds, so the
    decision still depends on nothing but past rounds and this round's confidences in order.

    For ``B`` beyond the table, the time per step is assumed to grow linearly with ``B`` from the
    last entry, i.e. ``SPS(B) = sps[-1] * len(sps) / B`` (a forward that is compute-bound at the
    end of the table stays compute-bound), see :meth:`step_rate`.

    Single request: with prefix survival ``s_k = c_1 * ... * c_k``, start at ``B = 1`` (the anchor
    token alone), ``E = 1``, ``best = SPS(1)``; for ``k = 1, 2, ...``: ``B += 1``, ``E += s_k``,
    ``Theta = SPS(B) * E``; stop at the first ``Theta <= best``, else ``best = Theta`` and
    ``keep = k``.

    ``R`` requests: the batched verify forward is a rectangle, every row padded to the longest,
    so it costs ``B = R x W`` tokens with ``W = 1 +`` the longest admitted position (at least
    ``min_width``), and ``E`` starts at ``R``. The unit of cost is a column: columns
    ``j = 1, 2, ...`` are opened while ``Theta = E * SPS(R x (j + 1))`` improves, each adding
    ``a_{r,j}`` of every row that has a position ``j`` (see :meth:`admit_batch`).
    """

    requires_confidences = True

    def __init__(self, sps: Sequence[float] | None = None, *, live: bool = False,
                 cost_model: StepCostModel | None = None, max_tokens: int | None = None) -> None:
        if cost_model is None:
            if sps is None:
                raise ValueError("PrefixScheduler needs an SPS table (sps=...) or a cost_model.")
            table = self._validate_table(sps)
            if live:
                cost_model = StepCostModel([1.0 / rate for rate in table])
        elif sps is not None:
            raise ValueError("PrefixScheduler takes either an SPS table or a cost_model, not both.")
        self._static_sps = None if cost_model is not None else table
        self.cost_model = cost_model
        self.max_tokens = max_tokens or (cost_model.prior_length if cost_model is not None else len(table))

    @property
    def sps(self) -> tuple[float, ...]:
        """The step-rate table in use now: the static table, or the live cost model's current one."""
        if self.cost_model is None:
            return self._static_sps
        return self.cost_model.sps(self.max_tokens)

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        """With a live cost model: a verify forward of ``num_tokens`` tokens took ``seconds``."""
        if self.cost_model is not None:
            self.cost_model.observe(num_tokens, seconds)

    @classmethod
    def from_model(cls, model: torch.nn.Module, max_tokens: int, *, live: bool = False,
                   **profile_kwargs: Any) -> "PrefixScheduler":
        """Profiles ``model`` with :func:`profile_sps` (cached on disk) and builds a scheduler.

        ``max_tokens`` should cover the largest verify forward, ``R * (gamma + 1)`` tokens for
        ``R`` requests; beyond it the table is extrapolated (see :meth:`step_rate`). With
        ``live=True`` the table is a prior that observed verify times correct
        (:class:`~dspark_hf.scheduling.cost_model.StepCostModel`).
        """
        return cls(profile_sps(model, max_tokens, **profile_kwargs), live=live)

    @staticmethod
    def _validate_table(sps: Sequence[float]) -> tuple[float, ...]:
        try:
            table = tuple(_as_float_list(sps))
        except (TypeError, ValueError):
            raise ValueError(
                f"SPS table must be a sequence of numbers, got {sps!r}; pass the table returned by "
                "profile_sps."
            ) from None
        if not table:
            raise ValueError(
                "SPS table is empty; pass the table returned by profile_sps (at least one entry, "
                "sps[B-1] = target steps per second for a forward of B tokens)."
            )
        for b, value in enumerate(table, start=1):
            # 1 / value must be finite too: a live cost model works on step times (1 / 1e-310 is inf).
            if not (math.isfinite(value) and value > 0.0 and math.isfinite(1.0 / value)):
                raise ValueError(
                    f"SPS table entry for B={b} is {value!r}; every entry must be a finite number "
                    "> 0 whose step time 1 / SPS is finite. Pass the table returned by profile_sps."
                )
        for b in range(1, len(table)):
            if table[b] > table[b - 1]:
                raise ValueError(
                    f"SPS table must be non-increasing in B, but SPS({b + 1}) = {table[b]!r} > "
                    f"SPS({b}) = {table[b - 1]!r}; pass the table returned by profile_sps or make it "
                    "non-increasing (e.g. fit the step times with monotone_step_times)."
                )
        return table

    def step_rate(self, num_tokens: int) -> float:
        """``SPS(B)`` for a forward of ``num_tokens = B >= 1`` tokens.

        Inside the table this is ``sps[B - 1]``. Beyond it, the time per step is assumed to grow
        linearly with ``B`` from the last entry: ``SPS(B) = sps[-1] * len(sps) / B``.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}.")
        return _rate_from_table(self.sps, num_tokens)

    # -- single request ------------------------------------------------------------------------

    def start_round(self, trace: list[float] | None = None) -> Callable[[float], bool]:
        table = self.sps
        tokens = 1  # B: the anchor token is always processed
        expected = 1.0  # E: the anchor/bonus token is always produced
        survival = 1.0
        best = table[0]
        if trace is not None:
            trace.append(best)

        def offer(confidence: float) -> bool:
            nonlocal tokens, expected, survival, best
            survival *= confidence
            tokens += 1
            expected += survival
            rate = _rate_from_table(table, tokens)
            theta = rate * expected
            if trace is not None:
                trace.append(theta)
            # Early stop: this is a correctness requirement, not a shortcut. c_{k+1} is computed
            # from the sampled token x_k, so looking at any Theta past the first drop would let
            # x_k decide whether x_k itself is verified, which biases the output distribution
            # (paper, Appendix A). Stopping here makes "k is admitted" a function of c_1..c_k
            # only, all known before x_k is drawn. (`not >` also stops on NaN.)
            if not theta > best:
                return False
            best = theta
            return True

        return offer

    def throughputs(self, confidences: Sequence[float]) -> list[float]:
        """The ``Theta`` values the single-request scheduler evaluates.

        Returns ``[Theta_0 = SPS(1), Theta_1, ...]`` up to and including the first non-improving
        one (or up to ``Theta_n`` when every position improves).
        """
        trace: list[float] = []
        offer_until_refused(self.start_round(trace), _as_float_list(confidences))
        return trace

    # -- many requests -------------------------------------------------------------------------

    def _admit_many(self, confidences_per_request: Sequence[Sequence[float]], trace: list[float] | None,
                    min_width: int = 1) -> list[int]:
        num_requests = len(confidences_per_request)
        if num_requests == 0:
            return []
        # Prefix survivals a_{r,j} = c_{r,1} ... c_{r,j}, each request's cut before its first a = 0.
        survivals: list[list[float]] = []
        for confidences in confidences_per_request:
            row, survival = [], 1.0
            for j, c in enumerate(_as_float_list(confidences), start=1):
                _check_confidence(c, j)
                survival *= c
                if survival <= 0.0:
                    break  # all later prefix products are 0 as well
                row.append(survival)
            survivals.append(row)

        table = self.sps  # one snapshot per round (a live cost model may change between rounds)
        # The verify forward is a rectangle of R rows x W tokens, so its unit of cost is a column:
        # position j of every row costs the same, whichever rows use it. Positions inside the width
        # the round has anyway (min_width) are free and all verified.
        width = max(1, int(min_width))
        lengths = [min(len(row), width - 1) for row in survivals]
        expected = num_requests + sum(sum(row[:n]) for row, n in zip(survivals, lengths))  # E
        best = expected * _rate_from_table(table, num_requests * width)
        if trace is not None:
            trace.append(best)
        for column in range(width, max(map(len, survivals), default=0) + 1):
            gain = sum(row[column - 1] for row in survivals if len(row) >= column)
            theta = (expected + gain) * _rate_from_table(table, num_requests * (column + 1))
            if trace is not None:
                trace.append(theta)
            # Early stop (see start_round): opening column j reads a_{r',j} of every row, built
            # from c_{r',1..j}, which depend on tokens before position j only; so whether x_{r,j}
            # is verified never depends on x_{r,j} itself. Looking past the first drop would.
            if not theta > best:
                break
            best, expected = theta, expected + gain
            lengths = [column if len(row) >= column else n for row, n in zip(survivals, lengths)]
        return lengths

    def admit_batch(self, confidences_per_request: Sequence[Sequence[float]], *, min_width: int = 1) -> list[int]:
        """Verification lengths for ``R`` requests decoded together: Algorithm 1 on the padded
        batch cost ``Theta = E * SPS(R x W)``, column by column.

        The verify forward pads every row to the longest, so it costs a whole column of ``R``
        tokens to verify position ``j`` of any row, and nothing more to verify it in every row.
        Each round therefore opens columns ``j = 1, 2, ...`` while ``Theta`` improves, adding the
        prefix survivals ``a_{r,j}`` of every row that has a position ``j``, and stops at the
        first column that does not improve it (the early stop that keeps it lossless). At
        ``R = 1`` this is :meth:`admit`. Visiting single candidates instead made one candidate pay
        for a column alone, which in a batch of several rows on CPU hardly ever happened.
        ``min_width``: see :meth:`VerifyPolicy.admit_batch`; positions inside it are free.
        """
        return self._admit_many(confidences_per_request, None, min_width)

    def batch_throughputs(self, confidences_per_request: Sequence[Sequence[float]], *,
                          min_width: int = 1) -> list[float]:
        """The ``Theta`` values :meth:`admit_batch` evaluates: the forward of width ``min_width``
        with every position inside it verified, then one per column opened, ending with the
        first non-improving one (or the last column)."""
        trace: list[float] = []
        self._admit_many(confidences_per_request, trace, min_width)
        return trace

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sps=<{len(self.sps)} entries, SPS(1)={self.sps[0]:.4g}>)"


def lookup_step_rates(policy: VerifyPolicy, target: torch.nn.Module, max_lookup_tokens: int) -> tuple[float, ...]:
    """The step-rate table the lookup choice reads: the prefix scheduler's (its live cost model's,
    long enough for the longest proposal and its anchor), else the target's shared cost model."""
    length = max_lookup_tokens + 1
    if isinstance(policy, PrefixScheduler):
        if policy.cost_model is None:
            return policy.sps
        return policy.cost_model.sps(max(length, policy.max_tokens))
    return shared_cost_model(target).sps(length)
