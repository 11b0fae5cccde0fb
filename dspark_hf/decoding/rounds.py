"""What both DSpark generation paths share, written once.

A round is the same idea at batch size 1 (:mod:`dspark_hf.decoding.candidate_generator`, inside
transformers' assisted-decoding loop) and batched (:mod:`dspark_hf.decoding.batched`, DSpark's own loop):
choose a source (context lookup or the draft), draft and schedule, verify, accept, record. This
module holds the pieces of that round that do not depend on which loop runs it:

* the round contract, :class:`RoundPlan`: what one round proposes and verifies for each running
  sequence (budget, source, the draft's sample, the confidences the policy read, its admitted
  length, the verified length), and :class:`RoundDecisions`, the one place that decides those
  fields for both loops: the budget, the source (:meth:`RoundDecisions.choose_sources`), whether
  to draft (:meth:`RoundDecisions.drafting_rows`), the verified length
  (:meth:`RoundDecisions.admit`: the policy, then the cut before the first non-finite position
  and after the first drafted EOS) and what the round teaches the policy, the gate and the
  choosers (:meth:`RoundDecisions.record`);
* round statistics (:class:`RoundStats`, :class:`DSparkGenerationStats`);
* trimming a proposal after its first EOS (:func:`cut_after_first_eos`);
* the lookup-or-draft choice of one sequence (:func:`choose_lookup`) and what each round teaches
  the chooser (:func:`record_source_round`).

What a round teaches the drafting gate is the gate's own business
(:func:`~dspark_hf.scheduling.drafting_gate.record_gate_round`).

It imports the policies' helpers (never the loops), so both loops may import it.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers.utils import logging

from .context_lookup import LookupProposal, SourceChooser
from ..scheduling.drafting_gate import record_gate_round
from ..scheduling.policies import VerifyPolicy, checked_admission, lookup_step_rates
from .serial_block import NON_FINITE_DRAFT_WARNING, SerialSample

if TYPE_CHECKING:
    from .settings import DSparkSettings

logger = logging.get_logger(__name__)

# Batched loop: after this many rounds in a row whose lookup copies were all refused, search for
# copies only every LOOKUP_PROBE_EVERY-th round (the choice reads past rounds only: lossless).
LOOKUP_REFUSALS_BEFORE_RESTING, LOOKUP_PROBE_EVERY = 8, 16

__all__ = [
    "DSparkGenerationStats",
    "RoundDecisions",
    "RoundPlan",
    "RoundStats",
    "choose_lookup",
    "cut_after_first_eos",
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
    batched generation records one ``RoundStats`` per running row and round, each with the round's
    ``batch_rows`` and padded ``batch_width`` (its forward verified ``batch_rows x batch_width`` tokens).
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
    batch_rows: int = 1  # rows in this round's verify forward
    batch_width: int = 1  # tokens per row of that forward (1 + the longest proposal: padding included)


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
                  eos_ids: frozenset[int]) -> tuple[LookupProposal | None, int]:
    """This round's lookup proposal for one sequence and how many of its tokens to verify.

    The chooser compares the lookup proposal's ``Theta = SPS(1 + l) * E[accepted + 1]`` with what
    recent DSpark rounds of this sequence delivered (:class:`~dspark_hf.decoding.context_lookup.SourceChooser`).
    A length of 0 means the round drafts instead; a kept copy ends after its first id in
    ``eos_ids`` (the call's EOS ids). The choice reads the sequence so far (``sequence``, 1-D) and
    past rounds only, never a token about to be verified.
    """
    proposal = chooser.lookup.propose(sequence, budget)
    keep = chooser.choose(proposal, sps)
    if keep > 0 and eos_ids:  # at most max_tokens ids: read them once, cut on the host
        keep = next((k + 1 for k, token in enumerate(proposal.tokens[:keep].tolist()) if token in eos_ids), keep)
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
# The round contract and the decisions both loops share
# ---------------------------------------------------------------------------------------------


@dataclass
class RoundPlan:
    """What one round proposes and verifies for its ``A`` running sequences (``A = 1`` at batch
    size 1); row ``i`` is the ``i``-th running sequence.

    The loop that runs the round sets ``anchors`` (through :meth:`RoundDecisions.start`), what the
    draft produced (``drafting``, ``draft_rows``, ``sample``, ``draft_time``, ``serial_time``) and
    ``verify_start``; :class:`RoundDecisions` decides everything else, the same way for both loops.

    Attributes:
        anchors: ``x0`` of each row, (A,).
        room: tokens each row may still emit before its length limit (its bonus token included).
        budgets: draft positions each row may verify: ``min(max_draft_tokens, room - 1)``.
        lengths: proposal tokens each row verifies (0: a plain target step); the source's
            tokens are ``lookups[i].tokens`` or the row's drafted tokens in ``sample``.
        lookups: the rows whose source is a context-lookup copy (:meth:`source`).
        lookup_confidences: per lookup row, the estimated acceptance of each kept copy token given
            the ones before it (past rounds), which the batched loop's joint admission reads.
        drafting: whether the draft ran this round.
        gate_asked: whether the drafting gate decided it (some row would have drafted); those
            rounds, drafted or not, teach the gate (at batch size 1 rows verifying lookup copies
            ride along either way).
        speculating: batched loop: whether the gate lets this round propose anything at all
            (lookup copies or drafts); a round it refuses is the target's plain batched step.
        draft_rows: the rows that drafted, (D,), in the order of ``sample``'s rows.
        sample: their serial sample (tokens, the logits they were drawn from, confidences).
        offered: per drafted row, the confidences the policy read: those offered one by one
            inside the serial loop, or the budget's, with 0.0 from the first non-finite position
            on, for a policy that decides on the whole block.
        admitted: per drafted row, the policy's length before the finite and EOS cuts.
        round_start, verify_start: ``time.perf_counter()`` when the round and its verify forward began.
        draft_time, serial_time, schedule_time: seconds in the draft forward (LM head included),
            the serial loop (the incremental policy included) and the rest of the decisions (the
            lookup search, the policy on the whole block, the cuts).
    """

    anchors: torch.LongTensor
    room: list[int]
    budgets: list[int]
    lengths: list[int]
    lookups: dict[int, LookupProposal] = field(default_factory=dict)
    lookup_confidences: dict[int, list[float]] = field(default_factory=dict)
    drafting: bool = False
    gate_asked: bool = False
    speculating: bool = True
    draft_rows: torch.Tensor | None = None
    sample: SerialSample | None = None
    offered: list[list[float]] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    round_start: float = 0.0
    verify_start: float = 0.0
    draft_time: float = 0.0
    serial_time: float = 0.0
    schedule_time: float = 0.0

    def source(self, row: int) -> str:
        """``"lookup"`` when row ``row`` verifies a context-lookup copy, else ``"dspark"`` (drafted or a plain step)."""
        return "lookup" if row in self.lookups else "dspark"


class RoundDecisions:
    """The decisions of one ``generate`` call's rounds that both loops take the same way.

    Each round: :meth:`start` (each row's budget), :meth:`choose_sources` (lookup or draft),
    :meth:`drafting_rows` (which rows the draft runs for, the gate asked), then after the draft
    :meth:`admit` (the verified lengths), and after verification :meth:`record`. Every decision
    reads the past rounds, the text so far and the confidences up to the position being decided,
    never the token being verified, so none of them changes the output.

    Args:
        settings: the call's resolved settings (policy, gate, lookup, ``max_draft_tokens``).
        target: the target model (the lookup choice reads its step rates).
        eos_token_ids: the call's EOS ids, or None.
        stats: the call's statistics; :meth:`record` appends one :class:`RoundStats` per row.
        batched: the batched loop decides all rows together with ``policy.admit_batch``. At batch
            size 1 a policy with the incremental form (``start_round``) decides inside the serial
            loop (:meth:`admission`), and one with only ``admit`` on the whole block.
    """

    def __init__(self, settings: "DSparkSettings", target: torch.nn.Module, eos_token_ids: torch.Tensor | None,
                 stats: DSparkGenerationStats, *, batched: bool) -> None:
        self.policy, self.gate, self.max_draft_tokens = settings.policy, settings.gate, settings.max_draft_tokens
        self.lookup_max_tokens = settings.lookup.max_tokens if settings.lookup is not None else 0
        self.target = target
        # The batched gate's estimate of a plain step before it has timed one.
        self.cost_model = getattr(self.policy, "cost_model", None) if batched else None
        self.eos_token_ids = eos_token_ids
        self.eos_id_set = frozenset(eos_token_ids.flatten().tolist()) if eos_token_ids is not None else frozenset()
        self.stats = stats
        self.batched = batched
        self.incremental = not batched and type(self.policy).start_round is not VerifyPolicy.start_round
        # A policy written before admit_batch took min_width is called as it was.
        self.batch_takes_width = "min_width" in inspect.signature(self.policy.admit_batch).parameters
        self.warned_non_finite = False
        # Batched rounds in a row whose lookup copies the joint admission refused entirely: past a
        # few, the rows draft instead and the per-row search (Python per row) rests.
        self.lookup_refused, self.rounds_started = 0, 0
        # Batched: when the last round was recorded. A batched round is charged from there, so the
        # loop's work between rounds (compaction, finished rows leaving) counts where it is caused.
        self.last_record: float | None = None

    # -- before the draft ----------------------------------------------------------------------

    def start(self, anchors: torch.LongTensor, room: list[int]) -> RoundPlan:
        """A new round for rows with anchors ``anchors`` and ``room[i]`` tokens left to emit."""
        plan = RoundPlan(anchors=anchors, room=list(room), budgets=[min(self.max_draft_tokens, n - 1) for n in room],
                         lengths=[0] * len(room), round_start=time.perf_counter())
        if self.batched and self.gate is not None and self._can_propose(room):
            # Batched, copies widen the forward for every row as drafts do, so the gate decides
            # whether the round proposes anything, against the plain batched step.
            if self.cost_model is not None:
                self.gate.plain_estimate = (len(room), self.cost_model.seconds(len(room)))
            plan.gate_asked = True
            plan.speculating = self.gate.should_draft()
        return plan

    def _can_propose(self, room: list[int]) -> bool:
        """Whether some row could verify a proposal this round (a source is on and it has room)."""
        return max(self.max_draft_tokens, self.lookup_max_tokens) > 0 and any(n > 1 for n in room)

    def lookup_sps(self) -> tuple[float, ...]:
        """The step-rate table the lookup choice reads (see :func:`~dspark_hf.scheduling.policies.lookup_step_rates`)."""
        return lookup_step_rates(self.policy, self.target, self.lookup_max_tokens)

    def choose_sources(self, plan: RoundPlan, choosers: list[SourceChooser],
                       sequences: list[torch.LongTensor]) -> None:
        """Each row's context-lookup proposal, kept where its chooser values it above DSpark
        (:func:`choose_lookup`, from the row's text so far, 1-D in ``sequences``, and its past
        rounds only); sets ``plan.lookups`` and those rows' ``plan.lengths``."""
        if not plan.speculating:
            return  # the gate made this batched round a plain step
        start = time.perf_counter()
        self.rounds_started += 1
        if self.lookup_refused >= LOOKUP_REFUSALS_BEFORE_RESTING and self.rounds_started % LOOKUP_PROBE_EVERY:
            return  # batched: the joint admission kept refusing the copies; search again now and then
        sps = self.lookup_sps()
        for i, (chooser, sequence) in enumerate(zip(choosers, sequences)):
            budget = min(self.lookup_max_tokens, plan.room[i] - 1)
            if budget < 1:
                continue  # room for the bonus token only
            proposal, keep = choose_lookup(chooser, sequence, budget, sps, self.eos_id_set)
            if keep > 0:
                plan.lookups[i], plan.lengths[i] = proposal, keep
                plan.lookup_confidences[i] = chooser.confidences(proposal, keep)
        plan.schedule_time += time.perf_counter() - start

    def drafting_rows(self, plan: RoundPlan) -> list[int]:
        """The rows the draft runs for: no lookup copy and room for a draft token. None when the
        drafting gate says drafting does not pay (at batch size 1 asked only when some row would
        draft; batched, decided for the whole round in :meth:`start`)."""
        wanting = [i for i, budget in enumerate(plan.budgets) if i not in plan.lookups and budget > 0]
        if self.batched:  # the gate decided at the start of the round
            return wanting if plan.speculating else []
        plan.gate_asked = bool(wanting) and self.gate is not None
        if not wanting or (plan.gate_asked and not self.gate.should_draft()):
            return []
        return wanting

    def admission(self):
        """The policy's ``offer`` for this round's serial loop (batch size 1, incremental policies), else None."""
        return self.policy.start_round() if self.incremental else None

    # -- after the draft -----------------------------------------------------------------------

    def admit(self, plan: RoundPlan) -> None:
        """Each drafted row's verified length, in ``plan.lengths``: the policy's admitted length
        (decided inside the serial loop, or here on the offered confidences), cut before the first
        position whose draft distribution or confidence is not finite (float16 overflow;
        :meth:`SerialSample.finite_lengths`, decided by the tokens before that position only) and
        just after the first drafted EOS (:func:`cut_after_first_eos`). Warns once per call when a
        non-finite value was met. Reads the device with at most two transfers."""
        start = time.perf_counter()
        sample, drafted = plan.sample, plan.draft_rows.tolist() if plan.drafting else []
        budgets = [plan.budgets[i] for i in drafted]
        if not drafted:  # batched, no row drafted: only lookup copies to admit
            plan.offered, usable = [], []
            plan.admitted = self._policy_lengths(plan, drafted)
            lengths, non_finite = [], False
        elif sample.num_admitted is not None:  # decided inside the serial loop (one row)
            plan.offered, plan.admitted = [list(sample.offered or [])], [sample.num_admitted]
            lengths, usable = self._cut(sample, plan.admitted, None)
            # A non-finite confidence is refused by the built-in policies: it is the last offered.
            offered = plan.offered[0]
            non_finite = (bool(offered) and not math.isfinite(offered[-1])) or usable[0] < plan.admitted[0]
        else:
            plan.offered, usable = self._offered_confidences(sample, budgets)
            plan.admitted = self._policy_lengths(plan, drafted)
            lengths, _ = self._cut(sample, plan.admitted, usable)
            non_finite = any(n < b for n, b in zip(usable, budgets))
        if non_finite:
            self.warn_non_finite()
        for i, k in zip(drafted, lengths):
            plan.lengths[i] = k
        plan.schedule_time += time.perf_counter() - start

    def _offered_confidences(self, sample: SerialSample, budgets: list[int]) -> tuple[list[list[float]], list[int]]:
        """What a policy deciding on the whole block reads, per drafted row: ``c_1..c_budget``
        (1.0 without a confidence head), 0.0 from the first non-finite position on, so every row
        offers its whole budget and the list's length says nothing the drawn tokens decide; and
        each row's finite length. One transfer."""
        usable = sample.finite_lengths()
        if sample.confidences is not None:
            read = torch.cat([sample.confidences, usable[:, None].to(sample.confidences)], dim=1).tolist()
        else:
            read = [[1.0] * sample.tokens.shape[1] + [n] for n in usable.tolist()]
        finite = [int(row[-1]) for row in read]
        offered = [[c if k < n else 0.0 for k, c in enumerate(row[:b])] for row, b, n in zip(read, budgets, finite)]
        return offered, finite

    def _policy_lengths(self, plan: RoundPlan, drafted: list[int]) -> list[int]:
        """The policy's lengths on ``plan.offered``: ``admit`` at batch size 1, ``admit_batch``
        over every running row (rows that do not draft offer nothing) in the batched loop."""
        if not self.batched:
            offered = plan.offered[0]
            return [checked_admission(self.policy, self.policy.admit(offered), len(offered))]
        per_row: list[list[float]] = [[] for _ in plan.lengths]
        for i, offered in zip(drafted, plan.offered):
            per_row[i] = offered
        # A lookup copy widens the padded forward for every row, so a policy that weighs confidences
        # admits its tokens jointly with the drafted ones, each offered at the copy's estimated
        # per-token acceptance (from past rounds); other policies verify the copy the chooser kept,
        # which fixes the forward's width before the draft.
        joint = [i for i in plan.lookups if self.policy.requires_confidences]
        for i in joint:
            per_row[i] = plan.lookup_confidences[i][: plan.lengths[i]]
        min_width = 1 + max((plan.lengths[i] for i in plan.lookups if i not in joint), default=0)
        admitted = (self.policy.admit_batch(per_row, min_width=min_width) if self.batch_takes_width
                    else self.policy.admit_batch(per_row))
        if not hasattr(admitted, "__len__") or len(admitted) != len(per_row):
            raise ValueError(f"{type(self.policy).__name__}.admit_batch returned {admitted!r}; it must return one "
                             f"verification length per request ({len(per_row)}).")
        admitted = [checked_admission(self.policy, k, len(offer), "admit_batch") for k, offer in zip(admitted, per_row)]
        for i in joint:
            plan.lengths[i] = admitted[i]
        return [admitted[i] for i in drafted]

    def _cut(self, sample: SerialSample, admitted: list[int], usable: list[int] | None) -> tuple[list[int], list[int]]:
        """``admitted`` cut before each row's first non-finite position and after its first EOS;
        returns the lengths and the finite lengths (``usable``, read here in the same transfer
        when not given). Nothing is read when nothing was admitted."""
        if not any(admitted):
            return [0] * len(admitted), usable if usable is not None else list(admitted)
        device = sample.tokens.device
        if usable is not None:
            capped = torch.tensor([min(k, n) for k, n in zip(admitted, usable)], device=device)
            return cut_after_first_eos(sample.tokens, capped, self.eos_token_ids).tolist(), usable
        finite = sample.finite_lengths()
        # One row (the serial loop decided): a clamp, no host-to-device copy of the length.
        capped = (finite.clamp(max=admitted[0]) if len(admitted) == 1
                  else torch.minimum(finite, finite.new_tensor(admitted)))
        cut = cut_after_first_eos(sample.tokens, capped, self.eos_token_ids)
        both = torch.cat([finite, cut.to(finite)]).tolist()
        return both[len(admitted):], both[: len(admitted)]

    def warn_non_finite(self) -> None:
        """Logs :data:`~dspark_hf.decoding.serial_block.NON_FINITE_DRAFT_WARNING` once per call."""
        if not self.warned_non_finite:
            self.warned_non_finite = True
            logger.warning(NON_FINITE_DRAFT_WARNING)

    # -- after verification --------------------------------------------------------------------

    def record(self, plan: RoundPlan, accepted: list[int], rows: list[int],
               choosers: list[SourceChooser] | None) -> None:
        """The round is over: row ``i`` (batch index ``rows[i]``) accepted ``accepted[i]`` of its
        ``plan.lengths[i]`` tokens. Appends one :class:`RoundStats` per row (the round's times
        shared), and the policy's cost model, each row's source chooser (``choosers[i]``) and the
        drafting gate learn from it."""
        now = time.perf_counter()
        began = self.last_record if self.batched and self.last_record is not None else plan.round_start
        active, verify_time, round_seconds = len(plan.lengths), now - plan.verify_start, now - began
        self.last_record = now
        width = 1 + max(plan.lengths)  # the forward was a rectangle: every row padded to the longest
        self.policy.observe_verify(active * width, verify_time)
        drafted = set(plan.draft_rows.tolist()) if plan.drafting else set()
        sps = self.lookup_sps() if choosers is not None else None
        for i, (row, verified, n) in enumerate(zip(rows, plan.lengths, accepted)):
            self.stats.rounds.append(RoundStats(
                verified=verified, accepted=n, draft_time=plan.draft_time / active,
                serial_time=plan.serial_time / active, schedule_time=plan.schedule_time / active,
                verify_time=verify_time / active, drafted=i in drafted, source=plan.source(i), row=row,
                batch_rows=active, batch_width=width))
            if choosers is not None:
                record_source_round(choosers[i], plan.lookups.get(i), verified, n,
                                    round_seconds / max(verify_time, 1e-9), sps)
        if self.batched and plan.lookups:
            admitted_any = any(plan.lengths[i] for i in plan.lookups)
            self.lookup_refused = 0 if admitted_any else self.lookup_refused + 1
        if plan.gate_asked:
            # Batched, the gate weighs whole rounds that were let speculate, copies included.
            drafted = plan.speculating if self.batched else plan.drafting
            record_gate_round(self.gate, drafted=drafted, verified=sum(plan.lengths),
                              produced=sum(accepted) + active, seconds=round_seconds,
                              drafting_seconds=plan.draft_time + plan.serial_time + plan.schedule_time,
                              sequences=active)
