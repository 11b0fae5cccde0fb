"""DSpark as a transformers candidate generator.

transformers' ``_assisted_decoding`` calls :meth:`DSparkCandidateGenerator.get_candidates` before
each target forward, verifies what it returns (greedy match or rejection sampling against the
returned logits), crops the target cache, and calls :meth:`update_candidate_strategy` with the
number of accepted tokens. One round here:

1. ingest the target hidden states of tokens accepted since the last call into the draft's context;
2. ask the drafting gate whether drafting has paid in recent rounds (if not: a plain target step);
3. one draft forward over ``[x0, MASK * (gamma - 1)]``;
4. serial sampling (Markov bias, logits processors) interleaved with the verify policy, which
   sees ``c_k`` before ``x_k`` is drawn and ends the block at its first refusal (0 tokens allowed);
5. return ``input_ids + x_1..x_keep`` and the logits those tokens were drawn from.

The first call returns no candidates so that transformers' prefill yields the prompt's hidden states.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.utils import logging

from .modeling_dspark import DSparkDraftModel
from .sampling import serial_sample
from .scheduler import DraftingGate, FixedLengthPolicy, PrefixScheduler, VerifyPolicy, profile_sps

logger = logging.get_logger(__name__)


@dataclass
class RoundStats:
    """One round: how many draft tokens were verified and accepted, and where the time went (seconds).

    ``drafted`` is False for rounds the drafting gate turned into plain target steps.
    ``draft_time`` includes the draft's LM head, which runs inside the serial loop once a first
    position is admitted. The serial loop and the policy are interleaved, so ``serial_time``
    includes the policy's decisions; ``schedule_time`` is what remains around them (EOS
    truncation).
    """

    verified: int
    accepted: int
    draft_time: float
    serial_time: float
    schedule_time: float
    verify_time: float
    drafted: bool = True


@dataclass
class DSparkGenerationStats:
    """Per-round statistics of one ``generate`` call, available as ``draft.generation_stats``.

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

    def scheduled_length_histogram(self) -> list[int]:
        """``hist[k]`` = number of rounds that verified k draft tokens."""
        hist = [0] * (self.block_size + 1)
        for r in self.rounds:
            hist[r.verified] += 1
        return hist

    def accepted_length_histogram(self) -> list[int]:
        """``hist[k]`` = number of rounds that accepted k draft tokens."""
        hist = [0] * (self.block_size + 1)
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

    def timings(self) -> dict[str, float]:
        """Total seconds per part of the round."""
        return {
            "draft_forward": sum(r.draft_time for r in self.rounds),
            "serial_sampling": sum(r.serial_time for r in self.rounds),
            "scheduler": sum(r.schedule_time for r in self.rounds),
            "target_verify": sum(r.verify_time for r in self.rounds),
        }


def resolve_drafting_gate(draft: DSparkDraftModel, policy: VerifyPolicy) -> DraftingGate | None:
    """A fresh gate for this call from ``draft.adaptive_drafting``: None (default) turns it on for
    the confidence-driven policies (scheduler, threshold) and off for fixed lengths; True/False
    force it; a :class:`DraftingGate` instance is copied (its settings, fresh history)."""
    choice = getattr(draft, "adaptive_drafting", None)
    if isinstance(choice, DraftingGate):
        return copy.deepcopy(choice)
    if choice is None:
        choice = bool(getattr(policy, "requires_confidences", False))
    elif not isinstance(choice, bool):
        raise ValueError(f"draft.adaptive_drafting must be None, True, False or a DraftingGate, got {choice!r}.")
    return DraftingGate() if choice else None


def resolve_verify_policy(draft: DSparkDraftModel, target: PreTrainedModel, num_rows: int = 1):
    """The draft's ``verify_policy``, or the default: a scheduler on an SPS table profiled up to
    ``num_rows * (gamma + 1)`` tokens (cached on disk) with a confidence head, the full block without."""
    policy = draft.verify_policy
    has_confidence = draft.confidence_head is not None
    if policy is None:
        if not has_confidence:
            return FixedLengthPolicy(draft.config.block_size)
        key = (id(target), num_rows)
        cached = getattr(draft, "_default_policy", None)
        if cached is None or cached[0] != key:
            sps = profile_sps(target, max_tokens=num_rows * (draft.config.block_size + 1))
            cached = (key, PrefixScheduler(sps))
            draft._default_policy = cached
        return cached[1]
    if getattr(policy, "requires_confidences", False) and not has_confidence:
        raise ValueError(
            f"verify_policy {type(policy).__name__} needs confidences, but this draft has no confidence head "
            "(a DFlash draft). Use FixedLengthPolicy or leave verify_policy=None."
        )
    return policy


class DSparkCandidateGenerator(CandidateGenerator):
    """Candidate generator for DSpark/DFlash drafts (``requires_model_outputs``).

    Args:
        draft: the DSpark draft (``assistant_model``).
        target: the model running ``generate``.
        generation_config: the call's generation config (sampling, lengths, outputs asked for).
        logits_processor: the call's processors; applied to draft logits position by position.
        batch_size: number of sequences; only 1 is supported for now.
    """

    requires_model_outputs = True

    def __init__(
        self,
        draft: DSparkDraftModel,
        target: PreTrainedModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None,
        batch_size: int,
    ):
        if batch_size > 1:
            raise ValueError(
                f"DSpark generation supports batch size 1 for now, got {batch_size}; generate prompts one at a time."
            )
        draft.bind_target(target)
        self.draft = draft
        self.target = target
        self.block_size = draft.config.block_size
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.eos_token_ids = generation_config._eos_token_tensor
        self.layer_indices = [i + 1 for i in draft.config.target_layer_ids]
        # A user asking for all hidden states in the output keeps the full tuple: a list-valued
        # selection would replace it and break transformers' output splitting.
        wants_all = generation_config.output_hidden_states and generation_config.return_dict_in_generate
        self.model_kwargs_overrides: dict[str, Any] = {"output_hidden_states": True if wants_all else self.layer_indices}
        self.policy = resolve_verify_policy(draft, target)
        self.gate = resolve_drafting_gate(draft, self.policy)
        # Policies with the incremental form decide inside the serial loop (a user policy may only have admit()).
        self.incremental = type(self.policy).start_round is not VerifyPolicy.start_round
        self.cache = draft.new_cache()
        self.device = draft.fc.weight.device
        # The block input [x0, MASK * (gamma - 1)] and its position offsets, reused every round.
        self.block_ids = torch.full((1, self.block_size), draft.config.mask_token_id, dtype=torch.long,
                                    device=self.device)
        self.block_offsets = torch.arange(self.block_size, device=self.device)
        self.stats = DSparkGenerationStats(block_size=self.block_size)
        draft.generation_stats = self.stats
        self._pending: dict[str, float] | None = None
        self._prompt_has_padding = False
        self._round_start = 0.0
        self._prefill_start: float | None = None
        self._embeds_offset = 0

    @torch.no_grad()
    def _ingest_context(self, input_ids: torch.LongTensor, model_kwargs: dict, model_outputs) -> None:
        """Adds the target hidden states of tokens the target processed since the last round."""
        cur_len = input_ids.shape[1] + self._embeds_offset  # positions the target has seen, prompt embeds included
        num_new = cur_len - 1 - self.cache.length
        if num_new <= 0:
            return
        hidden_states = getattr(model_outputs, "hidden_states", None)
        if hidden_states is None:
            raise RuntimeError(
                "The target's forward returned no hidden states; DSpark needs output_hidden_states support "
                "from the target model."
            )
        selected = [hidden_states[i] for i in self.layer_indices]
        if any(h is None or h.shape[1] < num_new for h in selected):
            raise RuntimeError("Target hidden states do not cover the accepted tokens; transformers' loop changed.")
        features = torch.cat([h[:, :num_new].to(self.device) for h in selected], dim=-1)
        start = self.cache.length
        attention_mask = model_kwargs.get("attention_mask")
        if start == 0:  # padding can only sit in the prompt, so check it once
            self._prompt_has_padding = attention_mask is not None and not bool(attention_mask.all())
        key_mask = None
        if self._prompt_has_padding:
            mask = attention_mask[:, : cur_len - 1].to(self.device)
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]
            key_mask = mask[:, start:].bool()
        else:
            positions = torch.arange(start, cur_len - 1, device=self.device).unsqueeze(0)
        self.draft.add_context(self.cache, features, positions, key_mask)
        self._next_position = positions[:, -1:] + 1

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Drafts, schedules and returns ``(input_ids + candidates, candidate logits)`` or ``(input_ids, None)``."""
        self._round_start = time.perf_counter()
        self._pending = None
        if is_first_iteration:
            self._prefill_start = self._round_start
            # With inputs_embeds (alone or longer than input_ids) the prompt's positions are not in input_ids.
            embeds = (model_kwargs or {}).get("inputs_embeds")
            if embeds is not None:
                self._embeds_offset = max(0, embeds.shape[1] - input_ids.shape[1])
            return input_ids, None
        if self._prefill_start is not None:
            self.stats.prefill_time = self._round_start - self._prefill_start
            self._prefill_start = None
        self._ingest_context(input_ids, model_kwargs or {}, model_outputs)
        budget = min(self.block_size, self.max_length - input_ids.shape[1] - 1)
        drafting = budget > 0 and (self.gate is None or self.gate.should_draft())
        if not drafting:  # the target still runs one forward: a plain step
            self._pending = {"verified": 0, "drafted": False, "draft": 0.0, "serial": 0.0,
                             "schedule": 0.0, "end": time.perf_counter()}
            return input_ids, None

        t0 = time.perf_counter()
        anchor = input_ids[:, -1]
        self.block_ids[:, 0] = anchor.to(self.device)
        # With incremental admission the LM head runs only once a position is admitted.
        out = self.draft(self.block_ids, self._next_position + self.block_offsets, self.cache,
                         compute_logits=not self.incremental)
        t1 = time.perf_counter()
        sample = serial_sample(
            self.draft,
            out.logits,
            out.hidden_states,
            anchor,
            do_sample=self.do_sample,
            logits_processor=self.logits_processor,
            prefix_ids=input_ids,
            admission=self.policy.start_round() if self.incremental else None,
            max_positions=budget,
        )
        t2 = time.perf_counter()
        if self.incremental:
            keep = sample.num_admitted
        else:  # a user policy with only admit(): decide on the whole block
            confidences = sample.confidences[0, :budget].tolist() if sample.confidences is not None else [1.0] * budget
            keep = self.policy.admit(confidences)
        if keep > 0 and self.eos_token_ids is not None:
            # Tokens after a drafted EOS can never be emitted; stopping at it depends only on
            # earlier tokens for every later position, so admission stays non-anticipating.
            is_eos = torch.isin(sample.tokens[0, :keep], self.eos_token_ids.to(sample.tokens.device))
            if bool(is_eos.any()):
                keep = int(is_eos.int().argmax()) + 1
        t3 = time.perf_counter()
        head = sample.lm_head_seconds  # the lazily run LM head belongs to the draft forward
        self._pending = {"verified": keep, "drafted": True, "draft": t1 - t0 + head, "serial": t2 - t1 - head,
                         "schedule": t3 - t2, "end": t3}
        if keep == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, sample.tokens[:, :keep].to(input_ids.device)], dim=1)
        return candidates, sample.logits[:, :keep]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Records the round: ``num_matches`` of the verified draft tokens were accepted."""
        if self._pending is None:
            return
        p = self._pending
        now = time.perf_counter()
        round_stats = RoundStats(
            verified=p["verified"],
            accepted=int(num_matches),
            draft_time=p["draft"],
            serial_time=p["serial"],
            schedule_time=p["schedule"],
            verify_time=now - p["end"],
            drafted=p["drafted"],
        )
        self.stats.rounds.append(round_stats)
        if self.gate is not None:
            round_seconds = now - self._round_start
            if round_stats.drafted:
                self.gate.record_drafted(round_stats.accepted + 1, round_seconds)
            if round_stats.verified == 0:  # the target ran a one-token step
                drafting = round_stats.draft_time + round_stats.serial_time + round_stats.schedule_time
                self.gate.record_plain(round_seconds - drafting)
        self._pending = None


__all__ = ["DSparkCandidateGenerator", "DSparkGenerationStats", "RoundStats", "resolve_drafting_gate",
           "resolve_verify_policy"]
