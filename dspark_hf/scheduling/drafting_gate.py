"""Whether to draft at all this round: :class:`DraftingGate`.

The gate decides from past rounds' outcomes and timings only, so it never changes what
speculative decoding emits; it only spares the draft's cost where drafting does not pay.
"""

from __future__ import annotations

__all__ = ["DraftingGate"]


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

    Rates compare like with like: ``drafted`` rounds give (accepted + 1) tokens over their whole
    wall time (draft forward, serial loop, scheduler, verification); ``plain`` rounds give one
    token per sequence over their wall time. Both come from the last ``window`` rounds of each kind. A round
    that drafted but verified nothing also tells the time of a plain step (its wall time minus the
    drafting). While drafting is off, every ``probe_every``-th round drafts anyway, so a change of
    content (prose turning into code) is noticed.

    Args:
        window: rounds of each kind the rates are computed over.
        probe_every: while drafting does not pay, draft on one round in this many.
        min_rounds: drafted rounds observed before the gate may turn drafting off.
    """

    def __init__(self, window: int = 16, probe_every: int = 16, min_rounds: int = 4) -> None:
        if window < 1 or probe_every < 1 or min_rounds < 1:
            raise ValueError(
                f"DraftingGate needs window, probe_every and min_rounds >= 1, got {window}, {probe_every}, {min_rounds}."
            )
        self.window = window
        self.probe_every = probe_every
        self.min_rounds = min_rounds
        self._drafted: list[tuple[int, float]] = []  # (tokens produced, seconds)
        self._plain: list[tuple[int, float]] = []  # (tokens produced, seconds) of plain target steps
        self._skipped_in_a_row = 0

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
        drafted, plain = self.drafted_rate(), self.plain_rate()
        if len(self._drafted) < self.min_rounds or plain is None or drafted >= plain:
            self._skipped_in_a_row = 0
            return True
        if self._skipped_in_a_row + 1 >= self.probe_every:
            self._skipped_in_a_row = 0
            return True
        self._skipped_in_a_row += 1
        return False

    def record_drafted(self, tokens: int, seconds: float) -> None:
        """A round that ran the draft produced ``tokens`` (accepted + bonus) in ``seconds``."""
        self._drafted = (self._drafted + [(tokens, seconds)])[-self.window :]

    def record_plain(self, seconds: float, tokens: int = 1) -> None:
        """A plain target step (one token per running sequence: ``tokens``) took ``seconds``."""
        self._plain = (self._plain + [(tokens, seconds)])[-self.window :]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window}, probe_every={self.probe_every})"

