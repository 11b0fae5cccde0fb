"""DSpark as a transformers candidate generator.

transformers' ``_assisted_decoding`` calls :meth:`DSparkCandidateGenerator.get_candidates` before
each target forward, verifies what it returns (greedy match or rejection sampling against the
returned logits), crops the target cache, and calls :meth:`update_candidate_strategy` with the
number of accepted tokens. One round here:

1. collect the target hidden states of tokens accepted since the last call (they wait until the
   draft next runs, so a round that does not draft makes no draft call);
2. with context lookup on, verify a lookup copy instead when its chooser values it above DSpark
   (no draft forward then);
3. ask the drafting gate whether drafting has paid in recent rounds (if not: a plain target step);
4. feed the collected states to the draft's context cache in one call, then one draft forward over
   ``[x0, MASK * (gamma - 1)]``;
5. serial sampling (Markov bias, logits processors) interleaved with the verify policy, which
   sees ``c_k`` before ``x_k`` is drawn and ends the block at its first refusal (0 tokens allowed);
6. return ``input_ids + x_1..x_keep`` and the logits those tokens were drawn from (in sampled
   calls a point mass for a lookup copy, and empty logits for a plain step, so that every sampled
   round is verified with one draw: :mod:`dspark_hf.decoding.verification`).

The round is a :class:`~dspark_hf.decoding.rounds.RoundPlan` with one row, and its budget, source,
verified length and record are decided by :class:`~dspark_hf.decoding.rounds.RoundDecisions`, as in the
batched loop; this module holds what is particular to transformers' loop (the context cache fed
from its model outputs, the candidates it expects).

The first call returns no candidates so that transformers' prefill yields the prompt's hidden states.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from ..model.configuration_dspark import hidden_state_indices
from .context_lookup import SourceChooser
from ..model.draft_runtime import record_generation_stats
from ..model.modeling_dspark import DSparkDraftModel
from .rounds import DSparkGenerationStats, RoundDecisions, RoundPlan, RoundStats
from .sampling import serial_sample
from .settings import resolve_settings
from .verification import begin_round, hand_over_drafted, point_mass_logits, sampled_verification_active


# Most target positions whose features wait for the draft's next run before they are fed anyway
# (about 7 KB each for SmolLM2's draft in float32).
MAX_PENDING_CONTEXT = 256


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
        self.policy = settings.policy
        self.chooser = SourceChooser(settings.lookup) if settings.lookup is not None else None
        self.cache = draft.new_cache()
        self.device = draft.fc.weight.device
        # The block input [x0, MASK * (gamma - 1)] and its position offsets, reused every round.
        self.block_ids = torch.full((1, self.block_size), draft.config.mask_token_id, dtype=torch.long,
                                    device=self.device)
        self.block_offsets = torch.arange(self.block_size, device=self.device)
        self.stats = DSparkGenerationStats(block_size=self.block_size)
        record_generation_stats(draft, self.stats)
        # Budget, source, admitted length and the record are decided there, as in the batched loop.
        self.rounds = RoundDecisions(settings, target, self.eos_token_ids, self.stats, batched=False)
        self.draft_row = torch.zeros(1, dtype=torch.long)  # the one row that drafts (RoundPlan.draft_rows)
        self.plan: RoundPlan | None = None  # the round in flight, recorded by update_candidate_strategy
        self._prompt_has_padding = False
        self._collected = 0  # positions whose target features are in the draft cache or pending
        self._pending_context: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._prefill_start: float | None = None
        self._embeds_offset = 0

    @property
    def num_drafting_tokens(self) -> int:
        """Most candidate tokens one round can propose (a draft block or a lookup copy).

        transformers >= 5.25 reads it to size how far back a recurrent cache must be able to crop.
        """
        return max(self.rounds.max_draft_tokens, self.rounds.lookup_max_tokens)

    @torch.no_grad()
    def _collect_context(self, input_ids: torch.LongTensor, model_kwargs: dict, model_outputs) -> None:
        """Keeps the target hidden states of tokens the target processed since the last round.

        They enter the draft's context cache when it drafts next (:meth:`_update_draft_context`, one
        call for all of them), so a round that drafts nothing (a plain step, a lookup copy) makes no
        draft call, and rounds that never draft cost what the target's own steps cost
        (``benchmarks/round_overhead.py plain``; measured: docs/performance.md).
        """
        cur_len = input_ids.shape[1] + self._embeds_offset  # positions the target has seen, prompt embeds included
        start = self._collected
        num_new = cur_len - 1 - start
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
        self._pending_context.append((features, positions, key_mask))
        self._collected = cur_len - 1
        self._next_position = positions[:, -1:] + 1
        if self._collected - self.cache.length >= MAX_PENDING_CONTEXT:  # long runs of lookup copies: bound the memory
            self._update_draft_context()

    def _update_draft_context(self) -> None:
        """Adds the collected target hidden states to the draft's context cache, in one call."""
        if not self._pending_context:
            return
        features, positions, key_masks = zip(*self._pending_context)
        self._pending_context = []
        key_mask = None if key_masks[0] is None else torch.cat(key_masks, dim=1)
        self.draft.add_context(self.cache, torch.cat(features, dim=1), torch.cat(positions, dim=1), key_mask)

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
        self.plan = None
        begin_round()
        if is_first_iteration:
            self._prefill_start = time.perf_counter()
            # With inputs_embeds (alone or longer than input_ids) the prompt's positions are not in input_ids.
            embeds = (model_kwargs or {}).get("inputs_embeds")
            if embeds is not None:
                self._embeds_offset = max(0, embeds.shape[1] - input_ids.shape[1])
            return input_ids, self._no_candidate_logits()
        plan = self.plan = self.rounds.start(input_ids[:, -1], [self.max_length - input_ids.shape[1]])
        if self._prefill_start is not None:
            self.stats.prefill_time = plan.round_start - self._prefill_start
            self._prefill_start = None
        self._collect_context(input_ids, model_kwargs or {}, model_outputs)
        if self.chooser is not None:
            self.rounds.choose_sources(plan, [self.chooser], [input_ids[0]])
        if plan.lookups:  # the draft forward is skipped
            tokens = plan.lookups[0].tokens[: plan.lengths[0]].to(input_ids.device)
            candidates, logits = torch.cat([input_ids, tokens[None]], dim=1), self._lookup_logits(tokens)
        elif self.rounds.drafting_rows(plan):
            candidates, logits = self._draft_round(input_ids, plan)
        else:  # the target still runs one forward: a plain step
            candidates, logits = input_ids, self._no_candidate_logits()
        plan.verify_start = time.perf_counter()
        return candidates, logits

    def _lookup_logits(self, tokens: torch.LongTensor) -> torch.Tensor | None:
        """A lookup copy is a deterministic draft: greedy rounds need no logits; sampled rounds
        verify it as a point mass, so transformers does not draw every position with
        ``torch.multinomial`` (see :mod:`dspark_hf.decoding.verification`)."""
        return point_mass_logits(tokens, self.draft.config.vocab_size) if self.do_sample else None

    def _no_candidate_logits(self) -> torch.Tensor | None:
        """A round without candidates (the prefill, a plain step): empty logits let DSpark's verification
        draw its token in sampled calls (transformers' own ``_speculative_sampling`` cannot take them)."""
        if self.do_sample and sampled_verification_active():
            return torch.empty(1, 0, self.draft.config.vocab_size, device=self.device)
        return None

    def _draft_round(self, input_ids: torch.LongTensor, plan: RoundPlan) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft forward and serial sampling (interleaved with an incremental policy); the verified
        length is decided by :meth:`RoundDecisions.admit`."""
        t0 = time.perf_counter()
        self._update_draft_context()  # part of what drafting costs (plain rounds no longer pay it)
        anchor = input_ids[:, -1]
        self.block_ids[:, 0] = anchor.to(self.device)
        # With incremental admission the LM head runs only once a position is admitted.
        out = self.draft(self.block_ids, self._next_position + self.block_offsets, self.cache,
                         compute_logits=not self.rounds.incremental)
        t1 = time.perf_counter()
        sample = serial_sample(
            self.draft,
            out.logits,
            out.hidden_states,
            anchor,
            do_sample=self.do_sample,
            logits_processor=self.logits_processor,
            prefix_ids=input_ids,
            admission=self.rounds.admission(),
            max_positions=plan.budgets[0],
            # DSpark's verification takes q from the loop (which may then draw over the draft vocabulary's columns).
            exact_probabilities=self.do_sample and sampled_verification_active(),
        )
        t2 = time.perf_counter()
        head = sample.lm_head_seconds  # the lazily run LM head belongs to the draft forward
        plan.drafting, plan.draft_rows, plan.sample = True, self.draft_row, sample
        plan.draft_time, plan.serial_time = t1 - t0 + head, t2 - t1 - head
        self.rounds.admit(plan)
        keep = plan.lengths[0]
        if keep == 0:
            return input_ids, self._no_candidate_logits()
        candidates = torch.cat([input_ids, sample.tokens[:, :keep].to(input_ids.device)], dim=1)
        probabilities = sample.probabilities[:, :keep] if sample.probabilities is not None else None
        return candidates, hand_over_drafted(sample.logits[:, :keep], probabilities)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Records the round: ``num_matches`` of the verified draft tokens were accepted."""
        if self.plan is None:
            return
        self.rounds.record(self.plan, [int(num_matches)], [0], [self.chooser] if self.chooser is not None else None)
        self.plan = None


# RoundStats and DSparkGenerationStats live in dspark_hf.decoding.rounds; importing them from here keeps working.
__all__ = ["DSparkCandidateGenerator", "DSparkGenerationStats", "RoundStats"]
