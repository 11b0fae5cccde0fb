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

import math
import time
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.utils import logging

from .configuration_dspark import hidden_state_indices
from .context_lookup import SourceChooser
from .modeling_dspark import DSparkDraftModel
from .rounds import (DSparkGenerationStats, RoundStats, choose_lookup, cut_after_first_eos, record_gate_round,
                     record_source_round)
from .sampling import NON_FINITE_DRAFT_WARNING, serial_sample
from .policies import VerifyPolicy, checked_admission, lookup_step_rates
from .draft_runtime import record_generation_stats
from .settings import resolve_settings

logger = logging.get_logger(__name__)


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
        self.layer_indices = hidden_state_indices(draft.config.target_layer_ids)
        # A user asking for all hidden states in the output keeps the full tuple: a list-valued
        # selection would replace it and break transformers' output splitting.
        wants_all = generation_config.output_hidden_states and generation_config.return_dict_in_generate
        self.model_kwargs_overrides: dict[str, Any] = {"output_hidden_states": True if wants_all else self.layer_indices}
        # This call's settings (draft generation_config, overridden by the call); all per-call state
        # lives on this object, never on the draft, so concurrent calls with one draft stay apart.
        settings = resolve_settings(draft, target, generation_config)
        self.policy, self.gate, self.max_draft_tokens = settings.policy, settings.gate, settings.max_draft_tokens
        self.chooser = SourceChooser(settings.lookup) if settings.lookup is not None else None
        # Policies with the incremental form decide inside the serial loop (a user policy may only have admit()).
        self.incremental = type(self.policy).start_round is not VerifyPolicy.start_round
        self.cache = draft.new_cache()
        self.device = draft.fc.weight.device
        # The block input [x0, MASK * (gamma - 1)] and its position offsets, reused every round.
        self.block_ids = torch.full((1, self.block_size), draft.config.mask_token_id, dtype=torch.long,
                                    device=self.device)
        self.block_offsets = torch.arange(self.block_size, device=self.device)
        self.stats = DSparkGenerationStats(block_size=self.block_size)
        record_generation_stats(draft, self.stats)
        self._pending: dict[str, float] | None = None
        self._prompt_has_padding = False
        self._round_start = 0.0
        self._prefill_start: float | None = None
        self._warned_non_finite = False
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
        budget = min(self.max_draft_tokens, self.max_length - input_ids.shape[1] - 1)
        if self.chooser is not None:
            lookup = self._propose_lookup(input_ids)
            if lookup is not None:
                return lookup
        drafting = budget > 0 and (self.gate is None or self.gate.should_draft())
        if not drafting:  # the target still runs one forward: a plain step
            self._pending = {"verified": 0, "drafted": False, "draft": 0.0, "serial": 0.0,
                             "schedule": 0.0, "end": time.perf_counter()}
            return input_ids, None
        return self._draft_round(input_ids, budget)

    def _draft_round(self, input_ids: torch.LongTensor, budget: int) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft forward, serial sampling interleaved with the policy, then the checks on what it kept."""
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
        keep = self._checked_length(sample, self._admitted_length(sample, budget))
        t3 = time.perf_counter()
        head = sample.lm_head_seconds  # the lazily run LM head belongs to the draft forward
        self._pending = {"verified": keep, "drafted": True, "draft": t1 - t0 + head, "serial": t2 - t1 - head,
                         "schedule": t3 - t2, "end": t3}
        if keep == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, sample.tokens[:, :keep].to(input_ids.device)], dim=1)
        return candidates, sample.logits[:, :keep]

    def _admitted_length(self, sample, budget: int) -> int:
        """The verification length the policy chose (incrementally, or on the whole block)."""
        if self.incremental:
            if sample.offered and not math.isfinite(sample.offered[-1]):
                self._warn_non_finite()  # the policy was offered a NaN confidence (built-in ones refuse it)
            return sample.num_admitted
        # A user policy with only admit(): decide on the whole block. Positions from the first
        # non-finite one on are offered as confidence 0.0 (admit() refuses NaN); the list keeps the
        # budget's length, so a policy that reads len() sees nothing the drawn tokens decide.
        # _checked_length then cuts before the first non-finite position.
        finite = sample.finite_lengths()[:1]
        if sample.confidences is None:
            read = [1.0] * budget + finite.tolist()
        else:
            read = torch.cat([sample.confidences[0, :budget], finite.to(sample.confidences)]).tolist()
        usable = int(read[-1])
        if usable < budget:
            self._warn_non_finite()
        confidences = [c if k < usable else 0.0 for k, c in enumerate(read[:-1])]
        return checked_admission(self.policy, self.policy.admit(confidences), len(confidences))

    def _checked_length(self, sample, keep: int) -> int:
        """``keep`` after the checks on the drafted tokens, read in one transfer: cut before the
        first position whose draft distribution or confidence is not finite (float16 overflow;
        rejection sampling would take NaN for q), see :meth:`SerialSample.finite_lengths`, which
        is decided by the tokens before that position only; and nothing after a drafted EOS can
        be emitted (see :func:`~dspark_hf.rounds.cut_after_first_eos`)."""
        if keep == 0:
            return 0
        finite = sample.finite_lengths()[:1]
        lengths = torch.minimum(finite, torch.full_like(finite, keep))
        cut = cut_after_first_eos(sample.tokens[:, :keep], lengths, self.eos_token_ids)
        usable, keep_after = torch.cat([finite, cut.to(finite)]).tolist()
        if usable < keep:
            self._warn_non_finite()
        return keep_after

    def _propose_lookup(self, input_ids: torch.LongTensor):
        """A context-lookup round when the chooser values it above DSpark (else None): the draft
        forward is skipped, and the tokens go to the target with no logits (a deterministic draft)."""
        start = time.perf_counter()
        budget = min(self.chooser.lookup.max_tokens, self.max_length - input_ids.shape[1] - 1)
        proposal, keep = choose_lookup(self.chooser, input_ids[0], budget, self.lookup_sps(), self.eos_token_ids)
        if keep == 0:
            return None
        end = time.perf_counter()
        self._pending = {"verified": keep, "drafted": False, "draft": 0.0, "serial": 0.0,
                         "schedule": end - start, "end": end, "lookup": proposal}
        return torch.cat([input_ids, proposal.tokens[None, :keep].to(input_ids.device)], dim=1), None

    def lookup_sps(self) -> tuple[float, ...]:
        """The step-rate table the lookup choice reads (see :func:`lookup_step_rates`)."""
        return lookup_step_rates(self.policy, self.target, self.chooser.lookup.max_tokens)

    def _warn_non_finite(self) -> None:
        if not self._warned_non_finite:
            self._warned_non_finite = True
            logger.warning(NON_FINITE_DRAFT_WARNING)

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
            source="lookup" if "lookup" in p else "dspark",
        )
        self.stats.rounds.append(round_stats)
        self.policy.observe_verify(round_stats.verified + 1, round_stats.verify_time)
        round_seconds = now - self._round_start
        if self.chooser is not None:
            record_source_round(self.chooser, p.get("lookup"), round_stats.verified, round_stats.accepted,
                                round_seconds / max(round_stats.verify_time, 1e-9), self.lookup_sps())
        if "lookup" not in p:
            drafting = round_stats.draft_time + round_stats.serial_time + round_stats.schedule_time
            record_gate_round(self.gate, drafted=round_stats.drafted, verified=round_stats.verified,
                              produced=round_stats.accepted + 1, seconds=round_seconds, drafting_seconds=drafting)
        self._pending = None


# RoundStats and DSparkGenerationStats live in dspark_hf.rounds; importing them from here keeps working.
__all__ = ["DSparkCandidateGenerator", "DSparkGenerationStats", "RoundStats"]
