"""Whether to draft at all this round: :class:`DraftingGate`.

The gate decides from past rounds' outcomes and timings only, so it never changes what
speculative decoding emits; it only spares the draft's cost where drafting does not pay.
"""

from __future__ import annotations

import math
import weakref
from typing import Hashable, Protocol

__all__ = ["BATCHED_GATE_MARGIN", "DraftingGate", "GateRecorder", "continue_earlier_gate", "forget_earlier_gates",
           "record_gate_round"]


# Batched rounds speculate only when they beat plain batched steps by this much (see DraftingGate).
BATCHED_GATE_MARGIN = 0.10


class DraftingGate:
    """Decides, from past rounds only, whether drafting pays this round.

    The draft forward and serial loop are paid every round, even when the scheduler then
    verifies nothing. Where recent rounds show that drafting produces fewer tokens per second
    than plain target steps (chat at temperature 1 with a weak draft, or a CPU whose multi-token
    forward costs far more than a one-token one), the gate skips drafting and the round becomes a
    plain target step.

    The decision is a function of earlier rounds' outcomes and timings only, never of this
    round's draft tokens, so the output stays exactly the target's (which tokens are proposed,
    or whether any are, never changes what speculative decoding emits).

    In the batched loop the gate decides for the whole round: whether any row proposes anything
    (a context-lookup copy widens the padded forward for every row as a draft does), so a batch
    whose proposals lose falls back to the target's plain batched steps.

    Rates compare like with like: ``drafted`` rounds give (accepted + 1) tokens over their whole
    wall time (draft forward, serial loop, scheduler, verification); ``plain`` rounds give one
    token per sequence over their wall time. Both come from the last ``window`` rounds of each kind. A round
    that drafted but verified nothing also tells the time of a plain step (its wall time minus the
    drafting). While drafting is off, every ``probe_every``-th round drafts anyway, so a change of
    content (prose turning into code) is noticed. A probe costs what a drafted round costs beyond a
    plain one, which grows with the batch (the draft runs for every row, the scheduler may verify
    none of it), so probes are spaced further apart when needed to keep their extra time within
    ``probe_budget`` of the plain rounds' time.

    Args:
        window: rounds of each kind the rates are computed over.
        probe_every: while drafting does not pay, draft on one round in this many (at least).
        min_rounds: drafted rounds observed before the gate may turn drafting off.
        probe_budget: the largest share of time probes may add while drafting is off.
        warmup_rounds: the first drafted rounds of a call, whose timings the gate does not record.
            The first use of the draft's and the verify's shapes in a process includes one-off
            work, several times a later round's time (measured: docs/performance.md): counted, it
            turned drafting off for a whole call whose drafting paid.
        margin: drafting stays on while its rate is at least ``1 + margin`` times the plain rate.
            Batched generation's default gate uses :data:`BATCHED_GATE_MARGIN`: a batched round
            that speculates is all but a tie with a plain one at large batches, and a tie lost
            to noise costs a whole batch.
    """

    def __init__(self, window: int = 16, probe_every: int = 16, min_rounds: int = 4,
                 probe_budget: float = 0.02, margin: float = 0.0, warmup_rounds: int = 1) -> None:
        if (window < 1 or probe_every < 1 or min_rounds < 1 or not probe_budget > 0 or not margin >= 0
                or warmup_rounds < 0):
            raise ValueError(
                f"DraftingGate needs window, probe_every and min_rounds >= 1, probe_budget > 0, margin >= 0 and "
                f"warmup_rounds >= 0, got {window}, {probe_every}, {min_rounds}, {probe_budget}, {margin}, {warmup_rounds}."
            )
        self.warmup_rounds = warmup_rounds
        self._warmup_left = warmup_rounds
        self.margin = margin
        self.window = window
        self.probe_every = probe_every
        self.min_rounds = min_rounds
        self.probe_budget = probe_budget
        self._drafted: list[tuple[int, float]] = []  # (tokens produced, seconds)
        self._plain: list[tuple[int, float]] = []  # (tokens produced, seconds) of plain target steps
        self._skipped_in_a_row = 0
        # (tokens, seconds) a plain round is expected to give, set by the batched loop from its cost
        # model. Not compared with: a profile can be off by x2 on a loaded machine. It marks a gate
        # that must time a plain round itself: once min_rounds drafted rounds are timed and no plain
        # round is, the next round is plain (a batch whose every round verifies something would
        # otherwise never learn what drafting competes with).
        self.plain_estimate: tuple[int, float] | None = None
        # Set by continue_earlier_gate when a smaller batch's gate found drafting lost: rounds between probes
        # while this gate has too few drafted rounds of its own to judge (None: no presumption).
        self._presumed_losing_interval: int | None = None

    @classmethod
    def for_batches(cls) -> "DraftingGate":
        """The gate batched generation makes by default. The draft runs for every row, so a
        speculating round that verifies little costs far more than a plain batched step at large
        ``R`` (``benchmarks/batched_variants.py``; measured: docs/performance.md); so the gate learns from 2 rounds (after
        its warm-up round) instead of 4, probes within 1% of the plain rounds' time instead of 2%,
        and speculates only while it beats plain steps by :data:`BATCHED_GATE_MARGIN`."""
        return cls(min_rounds=2, probe_budget=0.01, margin=BATCHED_GATE_MARGIN)

    def drafted_rate(self) -> float | None:
        """Tokens per second of recent drafted rounds (None before any)."""
        if not self._drafted:
            return None
        return sum(t for t, _ in self._drafted) / max(sum(s for _, s in self._drafted), 1e-12)

    def plain_rate(self) -> float | None:
        """Tokens per second of recent plain steps (None before any)."""
        if not self._plain:
            return None
        return sum(t for t, _ in self._plain) / max(sum(s for _, s in self._plain), 1e-12)

    def should_draft(self) -> bool:
        """Whether to run the draft this round."""
        if not self._plain and self.plain_estimate is not None and len(self._drafted) >= self.min_rounds:
            return False  # time a plain round (see plain_estimate)
        pays = self._drafting_pays()
        if pays is None and self._presumed_losing_interval is not None:
            return self._probe(self._presumed_losing_interval)
        if pays is not False:
            self._skipped_in_a_row = 0
            return True
        return self._probe(self.probe_interval())

    def _drafting_pays(self) -> bool | None:
        """Whether recent drafted rounds beat plain steps by the margin; None while too few rounds tell."""
        drafted, plain = self.drafted_rate(), self.plain_rate()
        if len(self._drafted) < self.min_rounds or plain is None:
            return None
        return drafted >= plain * (1.0 + self.margin)

    def _probe(self, interval: int) -> bool:
        """Drafting is off: True on every ``interval``-th round (a probe)."""
        if self._skipped_in_a_row + 1 >= interval:
            self._skipped_in_a_row = 0
            return True
        self._skipped_in_a_row += 1
        return False

    def drafting_lost(self) -> bool:
        """Whether this gate's recent rounds found drafting slower than plain steps (by its margin); while it
        has too few drafted rounds to judge, whether it presumes so (:meth:`presume_losing`)."""
        pays = self._drafting_pays()
        return self._presumed_losing_interval is not None if pays is None else not pays

    def presume_losing(self, earlier: "DraftingGate") -> None:
        """Starts with drafting off, probing as often as ``earlier`` did, until this gate has timed enough
        drafted rounds of its own to judge: ``earlier`` is a gate of a smaller batch (same draft and sampling)
        that found drafting lost. A wider batch verifies more rows per round for the same acceptance, so
        drafting pays less there, not more; presuming so spares a new batch size's first call the drafted
        rounds (the first of them cold) it would pay to learn that again. The probes still find the
        opposite where the content makes drafting pay."""
        self._presumed_losing_interval = earlier.probe_interval()

    def probe_interval(self) -> int:
        """Rounds between probes while drafting is off: ``probe_every``, or more where a drafted
        round's extra time over a plain round would exceed ``probe_budget`` of the plain rounds'."""
        if not self._drafted or not (self._plain or self.plain_estimate):
            return self.probe_every
        drafted = sum(s for _, s in self._drafted) / len(self._drafted)
        plain = (sum(s for _, s in self._plain) / len(self._plain) if self._plain
                 else self.plain_estimate[1])
        extra = max(drafted - plain, 0.0)
        return max(self.probe_every, math.ceil(extra / max(self.probe_budget * plain, 1e-12)))

    @property
    def warming_up(self) -> bool:
        """Whether the next drafted round is still a warm-up round (its timing is not recorded)."""
        return self._warmup_left > 0

    def record_drafted(self, tokens: int, seconds: float) -> None:
        """A round that ran the draft produced ``tokens`` (accepted + bonus) in ``seconds``
        (ignored while :attr:`warming_up`)."""
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return
        self._drafted = (self._drafted + [(tokens, seconds)])[-self.window :]

    def record_plain(self, seconds: float, tokens: int = 1) -> None:
        """A plain target step (one token per running sequence: ``tokens``) took ``seconds``."""
        self._plain = (self._plain + [(tokens, seconds)])[-self.window :]

    def continue_from(self, earlier: "DraftingGate") -> None:
        """Starts from what ``earlier`` (a gate of an earlier call with the same draft and rows) learnt:
        its recent rounds of each kind, without a warm-up (that call warmed the shapes up). A call
        whose predecessor found drafting did not pay then starts with plain steps and probes, instead
        of paying the drafted rounds it takes to learn that again."""
        self._drafted = list(earlier._drafted)[-self.window:]
        self._plain = list(earlier._plain)[-self.window:]
        self._presumed_losing_interval = earlier._presumed_losing_interval
        if self._drafted or self._plain:
            self._warmup_left = 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(window={self.window}, probe_every={self.probe_every}, "
                f"probe_budget={self.probe_budget}, margin={self.margin}, warmup_rounds={self.warmup_rounds})")


# The last default gate made per draft and call shape; a weak key, so a draft that is deleted takes its gates along.
_EARLIER_GATES: "weakref.WeakKeyDictionary[object, dict[Hashable, DraftingGate]]" = weakref.WeakKeyDictionary()


def continue_earlier_gate(owner: object, rows: int, sampling: Hashable, gate: DraftingGate) -> DraftingGate:
    """``gate``, continued from the last gate made for ``owner`` (the draft), ``rows`` and ``sampling`` in
    this process (:meth:`DraftingGate.continue_from`), and remembered for the next such call. With no such
    gate yet, a batch starts presuming drafting loses (:meth:`DraftingGate.presume_losing`) when the gate
    of the nearest smaller batch (2 rows or more, same sampling) found so. What earlier calls' rounds taught
    is process memory, like a kernel choice: it changes which rounds draft, never what a call emits."""
    gates = _EARLIER_GATES.setdefault(owner, {})
    earlier = gates.get((rows, sampling))
    if earlier is not None:
        gate.continue_from(earlier)
    else:
        smaller = [r for r, s in gates if s == sampling and 2 <= r < rows]
        if smaller and gates[(max(smaller), sampling)].drafting_lost():
            gate.presume_losing(gates[(max(smaller), sampling)])
    gates[(rows, sampling)] = gate
    return gate


def forget_earlier_gates(owner: object | None = None) -> None:
    """Drops what earlier calls' gates learnt, for ``owner`` (a draft) or for every draft: the next call
    learns afresh (for a benchmark of first calls, or after the content changes wholesale)."""
    if owner is None:
        _EARLIER_GATES.clear()
    else:
        _EARLIER_GATES.pop(owner, None)


class GateRecorder(Protocol):
    """What :func:`record_gate_round` needs of a gate (:class:`DraftingGate` or a gate of the user's own)."""

    def record_drafted(self, tokens: int, seconds: float) -> None: ...

    def record_plain(self, seconds: float, tokens: int = 1) -> None: ...


def record_gate_round(gate: GateRecorder | None, *, drafted: bool, verified: int, produced: int, seconds: float,
                      drafting_seconds: float, sequences: int = 1) -> None:
    """Feeds one DSpark round to the drafting gate (nothing without a gate).

    Args:
        drafted: whether the round ran the draft (batched: whether the gate let it propose
            anything, copies included).
        verified: draft tokens the verify forward checked (all rows together).
        produced: tokens the round emitted (accepted + one per sequence).
        seconds: the round's wall time, verification included.
        drafting_seconds: the part spent drafting (draft forward, serial loop, schedule).
        sequences: rows in the round; a plain step produces one token per row.

    Only rounds the gate decided are fed to it. A round the gate turned off is a plain round: its
    tokens over its time (at batch size 1 including a context-lookup copy, which rides along
    whether or not the draft runs, so both rates carry it alike; a batched round the gate turns
    off proposes nothing). A drafted round that verified nothing at all was a plain target step
    too: its time without the drafting is what a plain step costs (not while the gate is
    warming up: that forward ran cold as well).
    """
    if gate is None:
        return
    if not drafted:
        gate.record_plain(seconds, tokens=produced)
        return
    warming_up = getattr(gate, "warming_up", False)  # its verify forward was cold too
    gate.record_drafted(produced, seconds)
    if verified == 0 and not warming_up:
        gate.record_plain(seconds - drafting_seconds, tokens=sequences)
