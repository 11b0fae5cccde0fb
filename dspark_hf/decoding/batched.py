"""Batched DSpark generation: ``target.generate(input_ids, attention_mask=..., assistant_model=draft)``
with R > 1 (left-padded) prompts, which transformers' assisted decoding refuses.

One round for the R' rows still running (:class:`BatchedDSparkGeneration`, one method per step):

1. choose sources: with context lookup on, each row compares its own lookup proposal (copied from
   its prompt and generated text) with what DSpark delivered for it lately, from its own past
   rounds only (:func:`dspark_hf.decoding.rounds.choose_lookup`); rows that pick lookup skip drafting;
2. draft: one draft forward over the R' blocks ``[x0_r, MASK * (gamma - 1)]`` and serial sampling
   of the rows that draft (confidences ``c_{r,k}``); no draft forward when no row needs one, or
   when the drafting gate says drafting does not pay;
3. schedule: ``policy.admit_batch`` over the drafted rows' confidences and the lookup copies'
   estimated acceptance (paper Algorithm 1 on the padded forward: columns ``k = 1, 2, ...`` of
   every row opened while the expected throughput ``E * SPS(R x (k + 1))`` improves, with the
   early stop that keeps it lossless);
4. verify: one target forward over the ragged batch ``[x0_r, d_{r,1..k_r}]`` (right-padded to the
   longest row);
5. accept: per row, a greedy match, or speculative sampling against the draft's exact logits
   (``q`` one-hot for a lookup copy);
6. roll back and emit: per-row rollback of both caches; rows that finished (EOS, length, a
   stopping criterion) leave the batch and stop costing verification. The draft's context takes
   the round's target features only when the draft next runs (all waiting rounds in one call), so
   rounds that verify nothing cost what the target's own batched step costs plus bookkeeping.

The round is a :class:`~dspark_hf.decoding.rounds.RoundPlan`, and each row's budget, source, verified
length and record are decided by :class:`~dspark_hf.decoding.rounds.RoundDecisions`, the same code as at
batch size 1; this module holds the batched forwards, acceptance, ragged caches and stopping.

Ragged caches: rows accept different numbers of tokens, so after a round row r has ``n_r + 1``
valid new slots (anchor + accepted draft tokens) out of the ``1 + max_k`` appended. Both the
target's ``DynamicCache`` and the draft's context cache keep that slot layout, with one validity
mask over the slots (rejected and padding slots masked out of attention) and positions tracked per
row (RoPE is applied with each row's own ``position_ids``, so a hole changes nothing). When holes
outnumber valid slots, both caches are compacted (each row's valid slots gathered, left-padded):
memory stays within about twice the ideal plus one round. Finished rows are removed from both
caches with ``batch_select_indices``.

Supported: greedy and sampling, logits processors that do not read the sequence (temperature,
top-k, top-p, min-p, typical, epsilon, eta), every stopping criterion (EOS, length, stop strings,
custom criteria: each row stops at its own first firing position; ``max_time`` once a round).
Anything else (a repetition penalty, a streamer, scores in the output, ``use_cache=False``) is a
``ValueError`` naming the setting, never a silent change of the result.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList

from ..model.configuration_dspark import hidden_state_indices
from .context_lookup import SourceChooser
from ..model.draft_runtime import record_generation_stats
from ..model.modeling_dspark import DraftContextCache, DSparkDraftModel
from .rounds import DSparkGenerationStats, RoundDecisions, RoundPlan, cut_after_first_eos
from .sampling import serial_sample
from .serial_block import draw_categorical
from .settings import resolve_settings
from .verification import speculative_accept
from .stopping import first_stops, positional_criteria

SEQUENCE_FREE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                            TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)


def check_batched_support(logits_processor: LogitsProcessorList | None, generation_config: GenerationConfig,
                          streamer) -> None:
    """Raises ``ValueError`` for settings batched DSpark generation cannot honour exactly (every
    stopping criterion is honoured, see :func:`batched_dspark_generate`)."""
    unsupported = [type(p).__name__ for p in (logits_processor or []) if not isinstance(p, SEQUENCE_FREE_PROCESSORS)]
    if unsupported:
        raise ValueError(
            f"Batched DSpark generation (batch size > 1) supports logits processors that do not read the sequence "
            f"(temperature, top_k, top_p, min_p, typical_p, epsilon/eta cutoff), got {unsupported}. Drop those "
            "settings (e.g. repetition_penalty, no_repeat_ngram_size, min_new_tokens) or generate one prompt at a time."
        )
    if streamer is not None:
        raise ValueError("Streaming needs batch size 1; pass one prompt at a time with a streamer.")
    wants = [name for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
             if getattr(generation_config, name, False)]
    if wants:
        raise ValueError(f"Batched DSpark generation returns sequences only; unset {wants} or use batch size 1.")


def _compact(target_cache: DynamicCache, draft_cache: DraftContextCache, slot_mask: torch.Tensor) -> torch.Tensor:
    """Gathers each row's valid slots (left-padded) in both caches; returns the new slot mask."""
    counts = slot_mask.sum(dim=1)
    width = int(counts.max())
    # Stable sort puts invalid slots first and keeps valid ones in order; keep the last `width`.
    order = torch.sort(slot_mask.int(), dim=1, stable=True).indices[:, -width:]
    new_mask = torch.arange(width, device=slot_mask.device)[None] >= (width - counts)[:, None]

    def gather(tensor: torch.Tensor) -> torch.Tensor:  # (R, heads, L, d) -> (R, heads, width, d)
        index = order[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3]).to(tensor.device)
        return torch.gather(tensor, 2, index)

    for layer in target_cache.layers:
        layer.keys, layer.values = gather(layer.keys), gather(layer.values)
        if hasattr(layer, "cumulative_length"):  # sliding-window layers size their mask by it
            layer.cumulative_length = width
    for i in range(len(draft_cache.keys)):
        draft_cache.keys[i], draft_cache.values[i] = gather(draft_cache.keys[i]), gather(draft_cache.values[i])
    draft_cache.key_mask = new_mask.to(draft_cache.key_mask.device)
    draft_cache.length = width
    return new_mask


def _select_rows(target_cache: DynamicCache, draft_cache: DraftContextCache, keep: torch.Tensor) -> None:
    target_cache.batch_select_indices(keep)
    for i in range(len(draft_cache.keys)):
        if draft_cache.keys[i] is not None:  # None: the draft has not run yet (its context is still pending)
            draft_cache.keys[i] = draft_cache.keys[i][keep.to(draft_cache.keys[i].device)]
            draft_cache.values[i] = draft_cache.values[i][keep.to(draft_cache.values[i].device)]
    if draft_cache.key_mask is not None:
        draft_cache.key_mask = draft_cache.key_mask[keep.to(draft_cache.key_mask.device)]


def _check_sliding_window(cache: DynamicCache, max_tokens: int, longest_proposal: int) -> None:
    """Refuses a sliding-window target whose window the ragged slots could reach.

    Rows keep rejected and padding slots (masked) between compactions, so a sliding-window layer
    would count slots, not tokens, and drop context the target alone still sees. Below the window
    it is plain causal attention and exact. Compaction keeps at most max(32, 2 x tokens) slots, and
    a round adds one more than the longest proposal (gamma, or a longer context-lookup proposal).
    """
    windows = [layer.sliding_window for layer in cache.layers if getattr(layer, "sliding_window", None)]
    if not windows:
        return
    slots = max(32, 2 * max_tokens) + longest_proposal + 1
    if slots >= min(windows) - 1:
        raise ValueError(
            f"Batched DSpark generation keeps up to {slots} cache slots for {max_tokens} tokens (prompt + "
            f"max_new_tokens), which reaches this target's sliding attention window ({min(windows)}); the "
            "result would differ from the target alone. Lower max_new_tokens or the prompt length to stay "
            "below half the window, or generate one prompt at a time (batch size 1 has no such limit)."
        )


class BatchedDSparkGeneration:
    """One call of batched DSpark decoding: settings, caches, rows, statistics.

    :meth:`run` reads as the round: prefill once; then per round drop finished rows, choose each
    row's source, draft, schedule, verify, accept, roll back, emit, record. Each step is a method.
    """

    def __init__(self, target: PreTrainedModel, draft: DSparkDraftModel, input_ids: torch.LongTensor,
                 attention_mask: torch.Tensor | None, logits_processor: LogitsProcessorList | None,
                 generation_config: GenerationConfig, stopping_criteria: StoppingCriteriaList | None) -> None:
        draft.bind_target(target)
        self.target, self.draft, self.input_ids = target, draft, input_ids
        self.attention_mask_arg = attention_mask
        self.device, self.draft_device = input_ids.device, draft.fc.weight.device
        self.num_rows, self.prompt_len = input_ids.shape
        self.gamma = draft.config.block_size
        self.do_sample = bool(generation_config.do_sample)
        self.processors = logits_processor if logits_processor is not None and len(logits_processor) else None
        eos = generation_config._eos_token_tensor
        self.eos_ids = eos.to(self.device).flatten() if eos is not None else None
        pad = generation_config._pad_token_tensor
        self.pad_id = int(pad) if pad is not None else (int(self.eos_ids[0]) if self.eos_ids is not None else 0)
        self.max_new = generation_config.max_length - self.prompt_len
        if self.max_new < 1:
            raise ValueError(f"max_length {generation_config.max_length} leaves no room after the "
                             f"{self.prompt_len}-token prompt.")
        settings = resolve_settings(draft, target, generation_config, self.num_rows)  # this call's, never the draft's
        self.policy = settings.policy
        lookup = settings.lookup
        # Each row learns its own lookup acceptance and DSpark rate: rows differ in how much they copy.
        self.choosers = [SourceChooser(copy.deepcopy(lookup)) for _ in range(self.num_rows)] if lookup else None
        self.longest_proposal = max(self.gamma, lookup.max_tokens if lookup else 0)
        self.layer_indices = hidden_state_indices(draft.config.target_layer_ids)
        self.stats = DSparkGenerationStats(block_size=self.gamma)
        record_generation_stats(draft, self.stats)
        # Budgets, sources, admitted lengths and the record are decided there, as at batch size 1.
        self.rounds = RoundDecisions(settings, target, self.eos_ids, self.stats, batched=True)
        # EOS and length are enforced as tokens are emitted; other criteria are checked per position.
        self.positional = positional_criteria(stopping_criteria, generation_config)
        self.clocks = [c for c in stopping_criteria or [] if type(c) is MaxTimeCriteria]
        # Every row's whole sequence (left-padded prompt, then its tokens, then padding): the lookup
        # reads it, the stopping criteria see it, and it is the output.
        self.sequences = torch.full((self.num_rows, self.prompt_len + self.max_new), self.pad_id,
                                    dtype=torch.long, device=self.device)
        self.sequences[:, : self.prompt_len] = input_ids
        self.num_generated = [0] * self.num_rows
        self.done: set[int] = set()
        self.rows = list(range(self.num_rows))  # original index of each running row
        # Set by prefill(): both caches in the ragged slot layout, the slots' validity mask, each
        # running row's next position, each row's first prompt token; by verify(): the slots' positions.
        self.cache: DynamicCache | None = None
        self.draft_cache: DraftContextCache | None = None
        self.slot_mask = self.next_position = self.verify_positions = None
        self.first_real: list[int] = []
        # The draft's context is brought up to date only when the draft runs: a batch whose rounds
        # verify nothing (the gate off at large R) pays no draft work, not even for its prompt. Each
        # entry is the prompt's or one round's (features, positions, kept slots), all (rows, slots, ...).
        self.pending_context: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    # ----------------------------------------------------------------------------------- helpers
    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """The call's logits processors; they are sequence-free, so rows are independent."""
        return self.processors(self.input_ids[:1], scores) if self.processors is not None else scores

    def pick(self, scores: torch.Tensor) -> torch.Tensor:
        return draw_categorical(torch.softmax(scores, -1)) if self.do_sample else scores.argmax(-1)

    def features(self, outputs, width: int) -> torch.Tensor:
        """The target hidden states the draft reads, for the last ``width`` slots."""
        return torch.cat([outputs.hidden_states[i][:, -width:] for i in self.layer_indices],
                         dim=-1).to(self.draft_device)

    def run(self) -> torch.LongTensor:
        """Generates; returns ``(R, prompt + longest generation)`` token ids, early rows padded."""
        self.prefill()
        while self.drop_finished_rows():
            plan = self.choose_sources()
            self.draft_block(plan)
            self.schedule(plan)
            plan.verify_start = time.perf_counter()
            outputs, verify_ids, target_logits = self.verify(plan)
            accepted, next_tokens = self.accept(plan, verify_ids, target_logits)
            self.roll_back(outputs, verify_ids.shape[1], accepted)
            self.emit(verify_ids, accepted, next_tokens)
            self.rounds.record(plan, accepted.tolist(), self.rows,
                               [self.choosers[r] for r in self.rows] if self.choosers is not None else None)
            if self.slot_mask.shape[1] > 32 and self.slot_mask.shape[1] > 2 * int(self.slot_mask.sum(dim=1).max()):
                self.update_draft_context()  # both caches must hold the same slots to be compacted alike
                self.slot_mask = _compact(self.cache, self.draft_cache, self.slot_mask)
        longest = max(self.num_generated)
        return self.sequences[:, : self.prompt_len + longest].clone()

    # ----------------------------------------------------------------------------------- steps
    def prefill(self) -> None:
        """The target over the padded prompts; the draft's context will get every prompt slot."""
        mask = (self.input_ids.new_ones(self.input_ids.shape) if self.attention_mask_arg is None
                else self.attention_mask_arg).bool()
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        self.first_real = mask.int().argmax(dim=1).tolist()  # where each row's prompt starts
        self.cache = DynamicCache(config=self.target.config)
        _check_sliding_window(self.cache, self.prompt_len + self.max_new, self.longest_proposal)
        start = time.perf_counter()
        outputs = self.target(self.input_ids, attention_mask=mask.long(), position_ids=positions, cache=self.cache,
                              use_cache=True, output_hidden_states=self.layer_indices, logits_to_keep=1)
        first = self.pick(self.process(outputs.logits[:, -1].float()))
        self.draft_cache = self.draft.new_cache()
        self.pending_context = [(self.features(outputs, self.prompt_len), positions.to(self.draft_device),
                                 mask.to(self.draft_device))]
        self.stats.prefill_time = time.perf_counter() - start
        self.slot_mask = mask.clone()
        self.next_position = positions[:, -1] + 1
        self.emit_tokens(first[:, None], torch.ones_like(first))
        self.check_stops({r: 0 for r in range(self.num_rows)})

    def drop_finished_rows(self) -> bool:
        """Removes finished rows from both caches; False when none is left or ``max_time`` ran out."""
        keep = [i for i, r in enumerate(self.rows) if r not in self.done]
        if not keep:
            return False
        if any(bool(clock(self.input_ids[:1], None).any()) for clock in self.clocks):  # once a round
            return False
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, device=self.device)
            _select_rows(self.cache, self.draft_cache, index)
            self.pending_context = [tuple(part[index.to(part.device)] for part in entry) for entry in self.pending_context]
            self.slot_mask, self.next_position = self.slot_mask[index], self.next_position[index]
            self.rows = [self.rows[i] for i in keep]
        return True

    def choose_sources(self) -> RoundPlan:
        """A new round: each row's budget, and its lookup proposal where its chooser values it
        above DSpark for this row (from the row's own context and past rounds only)."""
        anchors = self.sequences[self.rows, [self.prompt_len + self.num_generated[r] - 1 for r in self.rows]]
        plan = self.rounds.start(anchors, [self.max_new - self.num_generated[r] for r in self.rows])
        if self.choosers is not None:
            sequences = [self.sequences[r, self.first_real[r]: self.prompt_len + self.num_generated[r]] for r in self.rows]
            self.rounds.choose_sources(plan, [self.choosers[r] for r in self.rows], sequences)
        return plan

    def draft_block(self, plan: RoundPlan) -> None:
        """One draft forward over every running row (they share the context cache) and serial
        sampling of the rows that draft (:meth:`RoundDecisions.drafting_rows`); skipped when no
        row needs it or the gate says drafting does not pay."""
        wanting = self.rounds.drafting_rows(plan)
        if not wanting:
            return
        t0 = time.perf_counter()
        self.update_draft_context()
        active = len(self.rows)
        block_ids = torch.full((active, self.gamma), self.draft.config.mask_token_id, dtype=torch.long,
                               device=self.device)
        block_ids[:, 0] = plan.anchors
        offsets = torch.arange(self.gamma, device=self.device)
        block = self.draft(block_ids, self.next_position[:, None] + offsets, self.draft_cache, compute_logits=False)
        plan.draft_rows = torch.tensor(wanting, device=self.device)
        hidden = (block.hidden_states if len(wanting) == active
                  else block.hidden_states[plan.draft_rows.to(block.hidden_states.device)])
        # N columns for a reduced draft vocabulary: serial_sample scatters them only where it draws over V.
        base_logits = self.draft.draft_vocab_logits(hidden).to(hidden.device)
        anchors = plan.anchors[plan.draft_rows]
        t1 = time.perf_counter()
        plan.sample = serial_sample(self.draft, base_logits, hidden, anchors, do_sample=self.do_sample,
                                    logits_processor=self.processors,
                                    prefix_ids=anchors[:, None] if self.processors else None,
                                    exact_probabilities=True)  # accept() verifies with the loop's own q
        plan.drafting = True
        plan.draft_time, plan.serial_time = t1 - t0, time.perf_counter() - t1

    def schedule(self, plan: RoundPlan) -> None:
        """The verification lengths of the drafted rows and the lookup copies
        (:meth:`RoundDecisions.admit`: ``admit_batch`` over every running row's confidences on the
        padded batch cost, then the cuts before the first non-finite position and after the first EOS)."""
        if plan.drafting or plan.lookups:
            self.rounds.admit(plan)

    def verify(self, plan: RoundPlan):
        """One target forward over the ragged batch ``[x0_r, proposal_r]`` (right-padded to the
        longest row); returns its outputs, the verified ids and the processed target logits."""
        active, width = len(self.rows), max(plan.lengths)
        lengths = torch.tensor(plan.lengths, device=self.device)
        slots = torch.arange(width + 1, device=self.device)
        verify_ids = torch.full((active, width + 1), self.pad_id, dtype=torch.long, device=self.device)
        verify_ids[:, 0] = plan.anchors
        if plan.sample is not None:
            drafted_width = min(width, self.gamma)
            verify_ids[plan.draft_rows, 1: 1 + drafted_width] = plan.sample.tokens[:, :drafted_width].to(self.device)
        for i, proposal in plan.lookups.items():
            verify_ids[i, 1: 1 + plan.lengths[i]] = proposal.tokens[: plan.lengths[i]].to(self.device)
        verify_ids = torch.where(slots[None] <= lengths[:, None], verify_ids, self.pad_id)
        self.verify_positions = self.next_position[:, None] + slots
        attention_mask = torch.cat([self.slot_mask, slots[None] <= lengths[:, None]], dim=1).long()
        outputs = self.target(verify_ids, attention_mask=attention_mask, position_ids=self.verify_positions,
                              cache=self.cache, use_cache=True, output_hidden_states=self.layer_indices,
                              logits_to_keep=width + 1)
        logits = outputs.logits.float()
        target_logits = self.process(logits.reshape(-1, logits.shape[-1])).view(active, width + 1, -1)
        return outputs, verify_ids, target_logits

    def accept(self, plan: RoundPlan, verify_ids: torch.LongTensor, target_logits: torch.Tensor):
        """Per row: accepted proposal tokens and the next token (greedy match, or speculative
        sampling with the draft's exact logits, ``q`` one-hot for lookup copies)."""
        lengths = torch.tensor(plan.lengths, device=self.device)
        proposed = verify_ids[:, 1:]
        if self.do_sample:
            sample, draft_logits, probabilities = plan.sample, None, None
            if sample is not None:
                draft_logits = sample.logits.to(self.device)
                probabilities = None if sample.probabilities is None else sample.probabilities.to(self.device)
            return speculative_accept(proposed, lengths, target_logits, draft_logits, plan.draft_rows, probabilities)
        choice = target_logits.argmax(-1)
        slots = torch.arange(proposed.shape[1], device=self.device)
        match = (proposed == choice[:, :-1]) & (slots[None] < lengths[:, None])
        accepted = match.int().cumprod(dim=1).sum(dim=1)
        return accepted, choice[torch.arange(len(self.rows), device=self.device), accepted]

    def roll_back(self, outputs, width: int, accepted: torch.Tensor) -> None:
        """Only the anchor and the accepted tokens stay valid, in both caches (ragged slots)."""
        kept_slots = torch.arange(width, device=self.device)[None] <= accepted[:, None]
        self.slot_mask = torch.cat([self.slot_mask, kept_slots], dim=1)
        self.pending_context.append((self.features(outputs, width), self.verify_positions.to(self.draft_device),
                                     kept_slots.to(self.draft_device)))
        self.next_position = self.next_position + accepted + 1

    def update_draft_context(self) -> None:
        """Adds the rounds' target features not yet in the draft's context cache, in one call."""
        if not self.pending_context:
            return
        features, positions, kept = (torch.cat(parts, dim=1) for parts in zip(*self.pending_context))
        self.pending_context = []
        self.draft.add_context(self.draft_cache, features, positions, kept)

    def emit(self, verify_ids: torch.LongTensor, accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Appends each row's accepted tokens and its next token, then applies the stopping criteria."""
        emitted = torch.cat([verify_ids[:, 1:], verify_ids[:, :1]], dim=1)
        emitted[torch.arange(len(self.rows), device=self.device), accepted] = next_tokens
        before = {r: self.num_generated[r] for r in self.rows}
        self.emit_tokens(emitted, accepted + 1)
        self.check_stops(before)

    def emit_tokens(self, emitted: torch.LongTensor, counts: torch.Tensor) -> None:
        """Writes the first ``counts[i]`` of ``emitted[i]`` after running row i's tokens, cut after
        an EOS and at the length limit; a row that reaches either is done."""
        counts = cut_after_first_eos(emitted, counts, self.eos_ids)
        room = torch.tensor([self.max_new - self.num_generated[r] for r in self.rows], device=self.device)
        counts = torch.minimum(counts, room)
        rows = torch.tensor(self.rows, device=self.device)
        starts = torch.tensor([self.prompt_len + self.num_generated[r] for r in self.rows], device=self.device)
        slots = torch.arange(emitted.shape[1], device=self.device)
        written = slots[None] < counts[:, None]
        self.sequences[rows[:, None].expand_as(emitted)[written], (starts[:, None] + slots)[written]] = emitted[written]
        last = emitted[torch.arange(len(self.rows), device=self.device), counts - 1]
        ended = torch.isin(last, self.eos_ids) if self.eos_ids is not None else torch.zeros_like(last, dtype=torch.bool)
        for r, count, eos in zip(self.rows, counts.tolist(), ended.tolist()):
            self.num_generated[r] += count
            if eos or self.num_generated[r] >= self.max_new:
                self.done.add(r)

    def check_stops(self, before: dict[int, int]) -> None:
        """Cuts each row at the first of its new positions where a positional criterion fires.
        Every row is passed, finished ones included, so a criterion sees row r at index r as in
        plain generate."""
        if not self.positional:
            return
        ends = [self.prompt_len + n for n in self.num_generated]
        sequences = [self.sequences[r, : ends[r]] for r in range(self.num_rows)]
        starts = [self.prompt_len + before.get(r, self.num_generated[r]) for r in range(self.num_rows)]
        for r, stop in enumerate(first_stops(self.positional, sequences, starts, filler=self.pad_id)):
            if stop is not None:
                self.sequences[r, stop:] = self.pad_id
                self.num_generated[r] = stop - self.prompt_len
                self.done.add(r)


@torch.no_grad()
def batched_dspark_generate(
    target: PreTrainedModel,
    draft: DSparkDraftModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    logits_processor: LogitsProcessorList | None,
    generation_config: GenerationConfig,
    stopping_criteria: StoppingCriteriaList | None = None,
) -> torch.LongTensor:
    """DSpark decoding of a left-padded batch; returns ``(R, prompt + longest generation)`` token ids,
    rows that stopped early padded with the pad token (as transformers pads finished rows).

    Each row stops at the first position where the stopping criteria fire on its own sequence
    (its left-padded prompt plus its tokens, as plain batched generate passes it); a
    ``MaxTimeCriteria`` is checked once per round and stops every row. See
    :class:`BatchedDSparkGeneration` for the round.
    """
    generation = BatchedDSparkGeneration(target, draft, input_ids, attention_mask, logits_processor,
                                         generation_config, stopping_criteria)
    return generation.run()


__all__ = ["BatchedDSparkGeneration", "batched_dspark_generate", "check_batched_support", "SEQUENCE_FREE_PROCESSORS"]
