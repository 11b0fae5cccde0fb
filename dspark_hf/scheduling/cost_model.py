"""The scheduler's cost model: target step time per number of tokens, corrected from live rounds.

The scheduler needs ``T(B)``, the time of one target forward over ``B`` new tokens. A profile
measured once (:func:`dspark_hf.scheduling.step_rates.profile_sps`) is a good prior but can be wrong for the
run at hand: taken while the machine was busy, at another context length, or read from a cache
file written under another machine state. :class:`StepCostModel` starts from that prior and
corrects it with the verify time every round observes, so a wrong prior stops misleading the
scheduler after a few dozen rounds.

The correction works on log time ratios ``r = log(observed / prior(B))``, in two levels, both
medians of recent observations (so an outlier, a page fault or a GC pause, changes nothing, and a
real change of machine state wins once it holds for half a window):

* a global level ``g``: the median ``r`` of the last ``window`` rounds, whatever ``B`` they
  verified. A profile that is uniformly too slow or too fast (taken under load, or on a faster
  machine) is corrected by any round;
* a per-size level: the median ``r`` of the last ``size_window`` rounds at that ``B``, which
  corrects the curve's shape (a context length that changes attention's share of the step). It is
  weighted ``n / (n + shrinkage)`` against ``g`` after ``n`` observations, so a size seen once does
  not override what all rounds say.

``T(B) = prior(B) * exp((1 - w_B) * g + w_B * m_B)``. A size no round has verified takes its
correction from the observed sizes around it (linear in ``B`` between two, the nearest one's beyond
them), so a prior whose shape is off (an estimate made without running the model, see
:func:`dspark_hf.scheduling.shared_cost.estimated_step_seconds`) is bent towards what the rounds
measured at every size, not only where they measured. The table handed to the scheduler is made
non-decreasing in ``B`` with :func:`monotone_step_times`, as the profile is.

Losslessness does not depend on any of this: the scheduler reads the table once at the start of a
round, and the table only holds times of earlier rounds.
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["StepCostModel", "monotone_step_times"]

# Least growth per token past the end of a prior table, as a share of its last entry.
MIN_TAIL_SLOPE = 0.01


def monotone_step_times(times: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit of step times (isotonic regression, equal weights).

    Uses pool-adjacent-violators: whenever a time is lower than the one before it, the two are
    replaced by their mean, and the pooling continues backwards while the order is still
    violated. A noisy dip is thereby averaged with its neighbours, while a real cliff (a jump up)
    is kept as it is.

    Args:
        times: measured seconds per forward for ``B = 1, 2, ...`` tokens.

    Returns:
        The fitted times, same length as ``times``, non-decreasing.
    """
    # Each block is [sum, count]; its fitted value is sum / count.
    blocks: list[list[float]] = []
    for t in (float(v) for v in times):
        blocks.append([t, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted: list[float] = []
    for total, count in blocks:
        fitted.extend([total / count] * int(count))
    return fitted


class StepCostModel:
    """Target step time ``T(B)``: a profiled prior corrected by observed verify times.

    Args:
        prior_seconds: profiled seconds per forward for ``B = 1..len(prior_seconds)`` tokens
            (positive, finite). Beyond the table, time grows linearly with ``B`` from the last
            entry (see :meth:`prior`).
        window: recent rounds the global level is the median of.
        size_window: recent rounds at one ``B`` its own level is the median of.
        shrinkage: pseudo-count pulling a rarely seen size's level towards the global one.
        drift_threshold: factor between live and prior times above which ``on_drift`` is called.
        min_observations: observations needed before ``on_drift`` may be called.
        on_drift: called as ``on_drift(model)`` (outside the lock) when the live estimate has
            moved from the last reported state by more than ``drift_threshold``, e.g. to warn and
            rewrite a cached profile.
        estimated: the prior was estimated without timing the model (not a profile): its level
            and shape are guesses the rounds are expected to correct, so drifting from it is no
            news (:attr:`estimated` is read by whoever reports drift).

    Thread-safe: several ``generate`` calls may share one model (it belongs to the target, not to
    one call).
    """

    def __init__(
        self,
        prior_seconds: Sequence[float],
        *,
        window: int = 16,
        size_window: int = 8,
        shrinkage: float = 2.0,
        drift_threshold: float = 1.5,
        min_observations: int = 16,
        on_drift: Callable[["StepCostModel"], None] | None = None,
        estimated: bool = False,
    ) -> None:
        prior = [float(t) for t in prior_seconds]
        if not prior or not all(math.isfinite(t) and t > 0 for t in prior):
            raise ValueError(f"StepCostModel needs a non-empty list of positive finite step times, got {prior_seconds!r}.")
        if window < 1 or size_window < 1 or not shrinkage >= 0 or not drift_threshold > 1.0 or min_observations < 1:
            raise ValueError(
                "StepCostModel: need window >= 1, size_window >= 1, shrinkage >= 0, drift_threshold > 1, "
                f"min_observations >= 1; got window={window}, size_window={size_window}, shrinkage={shrinkage}, "
                f"drift_threshold={drift_threshold}, min_observations={min_observations}."
            )
        self._prior = monotone_step_times(prior)
        self.shrinkage = shrinkage
        self.drift_threshold = drift_threshold
        self.min_observations = min_observations
        self.on_drift = on_drift
        self.estimated = estimated
        self._lock = threading.Lock()
        self._observations = 0
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)  # (B, seconds), any B
        self._recent_by_size: dict[int, deque[float]] = {}  # seconds per B
        self._size_window = size_window
        self._global = 0.0
        self._by_size: dict[int, float] = {}  # (1 - w) * g + w * m_B for observed sizes
        self._observed_sizes: list[int] = []  # sorted keys of _by_size
        self._reported: dict[int, float] = {}  # log corrections when on_drift was last called
        self._tables: dict[int, tuple[float, ...]] = {}  # memoised sps tables per length

    # -- reading ---------------------------------------------------------------------------------

    @property
    def prior_length(self) -> int:
        """Number of profiled sizes in the prior."""
        return len(self._prior)

    @property
    def num_observations(self) -> int:
        return self._observations

    def prior(self, num_tokens: int) -> float:
        """Prior seconds for ``num_tokens`` tokens; beyond the table, an affine extension with the
        slope of the table's second half (a forward's fixed part does not grow with ``B``, so
        scaling the last entry with ``B`` would overstate large batched forwards several times)."""
        n = len(self._prior)
        if num_tokens <= n:
            return self._prior[num_tokens - 1]
        return self._prior[-1] + self._tail_slope * (num_tokens - n)

    @property
    def _tail_slope(self) -> float:
        n = len(self._prior)
        half = (n + 1) // 2
        slope = (self._prior[-1] - self._prior[half - 1]) / (n - half) if n > half else 0.0
        # A flat table (a GPU below its compute bound) still grows somewhere past its end.
        return max(slope, self._prior[-1] * MIN_TAIL_SLOPE)

    def log_correction(self, num_tokens: int) -> float:
        """Log of the live estimate over the prior at ``B = num_tokens``: the size's own level
        when rounds verified it, else interpolated between the observed sizes around it."""
        sizes = self._observed_sizes
        by_size = self._by_size
        own = by_size.get(num_tokens)
        if own is not None:
            return own
        if not sizes:
            return self._global
        index = bisect.bisect_left(sizes, num_tokens)
        if index == 0:
            return by_size[sizes[0]]
        if index == len(sizes):
            return by_size[sizes[-1]]
        lo, hi = sizes[index - 1], sizes[index]
        share = (num_tokens - lo) / (hi - lo)
        return (1.0 - share) * by_size[lo] + share * by_size[hi]

    def observed_sizes(self) -> list[int]:
        """The forward sizes ``B`` the recent rounds verified (sorted)."""
        return list(self._observed_sizes)

    def seconds(self, num_tokens: int) -> float:
        """Current estimate of ``T(B)`` before the monotone fit."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}.")
        return self.prior(num_tokens) * math.exp(self.log_correction(num_tokens))

    def step_seconds(self, max_tokens: int) -> list[float]:
        """``T(1..max_tokens)``, made non-decreasing."""
        return monotone_step_times([self.seconds(b) for b in range(1, max_tokens + 1)])

    def sps(self, max_tokens: int) -> tuple[float, ...]:
        """The scheduler's table: steps per second for ``B = 1..max_tokens``, non-increasing."""
        table = self._tables.get(max_tokens)
        if table is None:
            rates = [1.0 / t for t in self.step_seconds(max_tokens)]
            for i in range(1, len(rates)):  # rounding in 1/t must not break monotonicity
                rates[i] = min(rates[i], rates[i - 1])
            table = tuple(rates)
            self._tables[max_tokens] = table
        return table

    # -- learning --------------------------------------------------------------------------------

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Records that a forward of ``num_tokens`` tokens took ``seconds``."""
        if num_tokens < 1 or not (math.isfinite(seconds) and seconds > 0):
            return  # a clock glitch or an empty round says nothing about the step time
        with self._lock:
            self._observations += 1
            self._recent.append((num_tokens, seconds))
            self._recent_by_size.setdefault(num_tokens, deque(maxlen=self._size_window)).append(seconds)
            self._update_levels_locked()
            drifted = self._drifted_locked()
        if drifted and self.on_drift is not None:
            self.on_drift(self)

    def extend_prior(self, prior_seconds: Sequence[float]) -> None:
        """Replaces the prior by a longer profile (``B = 1..len(prior_seconds)``, at least as long
        as the current one), keeping the observations: the levels are recomputed against it."""
        prior = [float(t) for t in prior_seconds]
        if len(prior) < len(self._prior) or not all(math.isfinite(t) and t > 0 for t in prior):
            raise ValueError(f"extend_prior needs at least {len(self._prior)} positive finite step times, "
                             f"got {len(prior)}.")
        with self._lock:
            self._prior = monotone_step_times(prior)
            if self._observations:
                self._update_levels_locked()
            self._tables = {}

    def _update_levels_locked(self) -> None:
        """The global and per-size log corrections from the recent observations (caller holds the lock)."""
        self._global = statistics.median(math.log(t / self.prior(b)) for b, t in self._recent)
        by_size = {}
        for size, times in self._recent_by_size.items():
            weight = len(times) / (len(times) + self.shrinkage)
            local = statistics.median(math.log(t / self.prior(size)) for t in times)
            by_size[size] = (1.0 - weight) * self._global + weight * local
        # Readers take the sizes first, then the levels (log_correction): sizes only ever gain
        # members, so the levels they then read hold every size they were given.
        self._by_size = by_size
        self._observed_sizes = sorted(by_size)
        self._tables = {}

    def _drifted_locked(self) -> bool:
        if self._observations < self.min_observations:
            return False
        limit = math.log(self.drift_threshold)
        baseline = self._reported.get(0, 0.0)  # key 0: the global level; sizes not yet reported follow it
        sizes = set(self._by_size) | set(self._reported)
        moved = abs(self._global - baseline) > limit or any(
            abs(self.log_correction(b) - self._reported.get(b, baseline)) > limit for b in sizes if b > 0)
        if moved:
            self._reported = {b: self.log_correction(b) for b in sizes if b > 0}
            self._reported[0] = self._global
        return moved

    def drift(self) -> float:
        """Largest factor between the live estimate and the prior over the sizes observed so far."""
        sizes = self._by_size or {1: 0}
        return max(math.exp(abs(self.log_correction(b))) for b in sizes)

    def __repr__(self) -> str:
        kind = "estimated prior" if self.estimated else "prior"
        return (f"{type(self).__name__}({kind} {len(self._prior)} sizes, {self._observations} observations, "
                f"drift x{self.drift():.2f})")
