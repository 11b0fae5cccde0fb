"""What both DSpark generation paths share, written once.

A round is the same idea at batch size 1 (:mod:`dspark_hf.candidate_generator`, inside
transformers' assisted-decoding loop) and batched (:mod:`dspark_hf.batched`, DSpark's own loop):
choose a source (context lookup or the draft), draft and schedule, verify, accept, record. This
module holds the pieces of that round that do not depend on which loop runs it:

* round statistics (:class:`RoundStats`, :class:`DSparkGenerationStats`);
* trimming a proposal after its first EOS (:func:`cut_after_first_eos`);
* the lookup-or-draft choice of one sequence (:func:`choose_lookup`) and what each round teaches
  the chooser (:func:`record_source_round`);
* the drafting gate's bookkeeping (:func:`record_gate_round`).

It imports nothing from the policies or the loops, so any of them may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .context_lookup import LookupProposal, SourceChooser

__all__ = [
    "DSparkGenerationStats",
    "RoundStats",
    "choose_lookup",
    "cut_after_first_eos",
    "record_gate_round",
    "record_source_round",
]


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


@dataclass
class RoundStats:
    """One round: how many draft tokens were verified and accepted, and where the time went (seconds).

    ``drafted`` is False for rounds the drafting gate turned into plain target steps, and for
    rounds that verified a context-lookup proposal (``source == "lookup"``) instead.
    ``draft_time`` includes the draft's LM head, which runs inside the serial loop once a first
    position is admitted. The serial loop and the policy are interleaved, so ``serial_time``
    includes the policy's decisions; ``schedule_time`` is what remains around them (EOS
    truncation, the lookup search). ``row`` is the sequence's index in the batch (0 at batch size 1);
    batched generation records one ``RoundStats`` per running row and round.
    """

    verified: int
    accepted: int
    draft_time: float
    serial_time: float
    schedule_time: float
    verify_time: float
    drafted: bool = True
    source: str = "dspark"  # "dspark" (drafted or a plain step) or "lookup" (copied from the context)
    row: int = 0


@dataclass
class DSparkGenerationStats:
    """Per-round statistics of one ``generate`` call, available as ``draft.last_generation_stats``
    (in the thread that made the call) and as the candidate generator's ``stats``.

    ``verify_time`` spans from the return of ``get_candidates`` to the next call into the generator,
    so it holds the target forward plus transformers' acceptance and bookkeeping.
    """

    block_size: int
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_time: float = 0.0  # the target's prompt forward (before the first round)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def verified_tokens(self) -> int:
        return sum(r.verified for r in self.rounds)

    @property
    def accepted_tokens(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens produced per target forward, bonus token included."""
        return (self.accepted_tokens + self.num_rounds) / max(self.num_rounds, 1)

    @property
    def drafted_fraction(self) -> float:
        """Share of rounds that ran the draft (the rest were skipped by the drafting gate)."""
        return sum(r.drafted for r in self.rounds) / max(self.num_rounds, 1)

    @property
    def verify_efficiency(self) -> float:
        """Accepted / verified draft tokens."""
        return self.accepted_tokens / max(self.verified_tokens, 1)

    def _histogram_size(self) -> int:
        # Lookup proposals may be longer than the draft's block.
        return max([self.block_size] + [r.verified for r in self.rounds]) + 1

    def scheduled_length_histogram(self) -> list[int]:
        """``hist[k]`` = number of rounds that verified k draft tokens (either source)."""
        hist = [0] * self._histogram_size()
        for r in self.rounds:
            hist[r.verified] += 1
        return hist

    def accepted_length_histogram(self) -> list[int]:
        """``hist[k]`` = number of rounds that accepted k draft tokens (either source)."""
        hist = [0] * self._histogram_size()
        for r in self.rounds:
            hist[r.accepted] += 1
        return hist

    def per_position_acceptance(self) -> list[float | None]:
        """Conditional acceptance per position: P(k accepted | 1..k-1 accepted and k verified)."""
        rates: list[float | None] = []
        for k in range(1, self.block_size + 1):
            tried = sum(1 for r in self.rounds if r.verified >= k and r.accepted >= k - 1)
            passed = sum(1 for r in self.rounds if r.accepted >= k)
            rates.append(passed / tried if tried else None)
        return rates

    def source_shares(self, row: int | None = None) -> dict[str, float]:
        """Share of rounds per draft source (of one batch row's rounds when ``row`` is given)."""
        rounds = [r for r in self.rounds if row is None or r.row == row]
        shares: dict[str, float] = {}
        for r in rounds:
            shares[r.source] = shares.get(r.source, 0.0) + 1.0 / len(rounds)
        return shares

    def acceptance_by_source(self) -> dict[str, float]:
        """Accepted / verified draft tokens per source."""
        totals: dict[str, list[int]] = {}
        for r in self.rounds:
            counts = totals.setdefault(r.source, [0, 0])
            counts[0] += r.accepted
            counts[1] += r.verified
        return {source: accepted / verified for source, (accepted, verified) in totals.items() if verified}

    def timings(self) -> dict[str, float]:
        """Total seconds per part of the round."""
        return {
            "draft_forward": sum(r.draft_time for r in self.rounds),
            "serial_sampling": sum(r.serial_time for r in self.rounds),
            "scheduler": sum(r.schedule_time for r in self.rounds),
            "target_verify": sum(r.verify_time for r in self.rounds),
        }


# ---------------------------------------------------------------------------------------------
# Scheduling pieces
# ---------------------------------------------------------------------------------------------


def cut_after_first_eos(tokens: torch.LongTensor, lengths: torch.Tensor,
                        eos_token_ids: torch.Tensor | None) -> torch.Tensor:
    """Each row's proposal length cut just after its first EOS.

    Args:
        tokens: proposed tokens, (R, K).
        lengths: how many leading tokens of each row are proposed, (R,) with values in ``0..K``.
        eos_token_ids: the call's EOS ids (any shape), or None.

    Returns:
        The new lengths, (R,) on ``lengths``' device. Nothing after an EOS can be emitted, and
        the cut reads only tokens before each position, so a policy's admission stays
        non-anticipating. The caller reads the result when it needs it (one transfer).
    """
    if eos_token_ids is None or tokens.shape[1] == 0:
        return lengths
    within = torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths.to(tokens.device)[:, None]
    is_eos = torch.isin(tokens, eos_token_ids.to(tokens.device)) & within
    through_first = is_eos.int().argmax(dim=1) + 1
    return torch.where(is_eos.any(dim=1), through_first, lengths.to(tokens.device)).to(lengths.device)


# ---------------------------------------------------------------------------------------------
# Source choice: context lookup or the draft
# ---------------------------------------------------------------------------------------------


def choose_lookup(chooser: SourceChooser, sequence: torch.LongTensor, budget: int, sps: tuple[float, ...],
                  eos_token_ids: torch.Tensor | None) -> tuple[LookupProposal | None, int]:
    """This round's lookup proposal for one sequence and how many of its tokens to verify.

    The chooser compares the lookup proposal's ``Theta = SPS(1 + l) * E[accepted + 1]`` with what
    recent DSpark rounds of this sequence delivered (:class:`~dspark_hf.context_lookup.SourceChooser`).
    A length of 0 means the round drafts instead. The choice reads the sequence so far
    (``sequence``, 1-D) and past rounds only, never a token about to be verified.
    """
    proposal = chooser.lookup.propose(sequence, budget)
    keep = chooser.choose(proposal, sps)
    if keep > 0:
        lengths = torch.tensor([keep], device=proposal.tokens.device)
        keep = int(cut_after_first_eos(proposal.tokens[None, :keep], lengths, eos_token_ids)[0])
    return proposal, keep


def record_source_round(chooser: SourceChooser, lookup: LookupProposal | None, verified: int, accepted: int,
                        round_over_verify: float, sps: tuple[float, ...]) -> None:
    """Teaches the chooser one round of one sequence: a lookup round updates the lookup's
    acceptance estimate; a DSpark round (drafted or a plain step) what DSpark delivers per unit of
    cost, the whole round taking ``round_over_verify`` times as long as its verify forward."""
    if lookup is not None:
        chooser.record_lookup(lookup, verified, accepted)
    else:
        chooser.record_dspark(accepted + 1, verified, round_over_verify, sps)


# ---------------------------------------------------------------------------------------------
# Drafting-gate bookkeeping
# ---------------------------------------------------------------------------------------------


class GateRecorder(Protocol):
    """What :func:`record_gate_round` needs of a gate (:class:`~dspark_hf.scheduler.DraftingGate`)."""

    def record_drafted(self, tokens: int, seconds: float) -> None: ...

    def record_plain(self, seconds: float, tokens: int = 1) -> None: ...


def record_gate_round(gate: GateRecorder | None, *, drafted: bool, verified: int, produced: int, seconds: float,
                      drafting_seconds: float, sequences: int = 1) -> None:
    """Feeds one DSpark round to the drafting gate (nothing without a gate).

    Args:
        drafted: whether the round ran the draft.
        verified: draft tokens the verify forward checked (all rows together).
        produced: tokens the round emitted (accepted + one per sequence).
        seconds: the round's wall time, verification included.
        drafting_seconds: the part spent drafting (draft forward, serial loop, schedule).
        sequences: rows in the round; a plain step produces one token per row.

    A round that verified nothing was a plain target step, whether or not it drafted first: its
    time without the drafting is what a plain step costs. Rounds that verified a context-lookup
    proposal are not fed to the gate (they measure neither drafting nor plain steps).
    """
    if gate is None:
        return
    if drafted:
        gate.record_drafted(produced, seconds)
    if verified == 0:
        gate.record_plain(seconds - drafting_seconds, tokens=sequences)
