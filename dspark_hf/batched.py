"""Batched DSpark generation: ``target.generate(input_ids, attention_mask=..., assistant_model=draft)``
with R > 1 (left-padded) prompts, which transformers' assisted decoding refuses.

One round for the R' rows still running:

1. one draft forward over the R' blocks ``[x0_r, MASK * (gamma - 1)]`` and serial sampling of all
   rows together (confidences ``c_{r,k}``);
2. ``policy.admit_batch`` over every row's confidences (paper Algorithm 1: candidates ``(r, k)``
   admitted by descending prefix survival while the expected throughput
   ``E * SPS(total verified tokens)`` improves, with the early stop that keeps it lossless);
3. one target forward over the ragged verification batch ``[x0_r, d_{r,1..k_r}]`` (right-padded
   to the longest row);
4. per-row acceptance (greedy match, or speculative sampling against the draft's exact logits)
   and per-row rollback; rows that finished (EOS, length) leave the batch and stop costing
   verification.

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


from transformers.utils import logging

from .candidate_generator import DSparkGenerationStats, RoundStats
from .configuration_dspark import hidden_state_indices
from .modeling_dspark import DraftContextCache, DSparkDraftModel
from .sampling import NON_FINITE_DRAFT_WARNING, serial_sample
from .settings import record_generation_stats, resolve_settings
from .stopping import first_stops, positional_criteria

logger = logging.get_logger(__name__)

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
        draft_cache.keys[i] = draft_cache.keys[i][keep.to(draft_cache.keys[i].device)]
        draft_cache.values[i] = draft_cache.values[i][keep.to(draft_cache.values[i].device)]
    draft_cache.key_mask = draft_cache.key_mask[keep.to(draft_cache.key_mask.device)]


def _speculative_accept(draft_tokens, draft_logits, target_logits, lengths):
    """Per-row speculative sampling (Leviathan et al.). draft_tokens (R, K), draft_logits (R, K, V),
    target_logits (R, K + 1, V) after processors, lengths k_r (R,). Returns (accepted n_r, next token)."""
    rows, width = draft_tokens.shape
    p = torch.softmax(target_logits, dim=-1)
    if width == 0:
        return torch.zeros(rows, dtype=torch.long, device=p.device), torch.multinomial(p[:, 0], 1).squeeze(1)
    q = torch.softmax(draft_logits, dim=-1)
    p_tok = p[:, :width].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_tok = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accept = torch.rand(rows, width, device=p.device) * q_tok <= p_tok  # u < p/q without dividing by 0
    accept &= torch.arange(width, device=p.device)[None] < lengths[:, None]
    accepted = accept.int().cumprod(dim=1).sum(dim=1)
    row_index = torch.arange(rows, device=p.device)
    p_next = p[row_index, accepted]
    rejected = accepted < lengths
    residual = (p_next - q[row_index, accepted.clamp(max=width - 1)]).clamp(min=0)
    residual_sum = residual.sum(-1, keepdim=True)
    # On a rejection the next token comes from norm(max(0, p - q)); after a full acceptance from p.
    use_residual = rejected[:, None] & (residual_sum > 0)
    distribution = torch.where(use_residual, residual / residual_sum.clamp(min=1e-30), p_next)
    return accepted, torch.multinomial(distribution, 1).squeeze(1)


def _check_sliding_window(cache: DynamicCache, max_tokens: int, gamma: int) -> None:
    """Refuses a sliding-window target whose window the ragged slots could reach.

    Rows keep rejected and padding slots (masked) between compactions, so a sliding-window layer
    would count slots, not tokens, and drop context the target alone still sees. Below the window
    it is plain causal attention and exact. Compaction keeps at most max(32, 2 x tokens) slots, and
    a round adds gamma + 1.
    """
    windows = [layer.sliding_window for layer in cache.layers if getattr(layer, "sliding_window", None)]
    if not windows:
        return
    slots = max(32, 2 * max_tokens) + gamma + 1
    if slots >= min(windows) - 1:
        raise ValueError(
            f"Batched DSpark generation keeps up to {slots} cache slots for {max_tokens} tokens (prompt + "
            f"max_new_tokens), which reaches this target's sliding attention window ({min(windows)}); the "
            "result would differ from the target alone. Lower max_new_tokens or the prompt length to stay "
            "below half the window, or generate one prompt at a time (batch size 1 has no such limit)."
        )


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
    ``MaxTimeCriteria`` is checked once per round and stops every row.
    """
    draft.bind_target(target)
    device = input_ids.device
    num_rows, prompt_len = input_ids.shape
    gamma = draft.config.block_size
    do_sample = bool(generation_config.do_sample)
    processors = logits_processor if logits_processor is not None and len(logits_processor) else None
    eos_tensor = generation_config._eos_token_tensor
    eos_ids = eos_tensor.to(device).flatten() if eos_tensor is not None else None
    eos_set = set(eos_ids.tolist()) if eos_ids is not None else set()
    pad = generation_config._pad_token_tensor
    pad_id = int(pad) if pad is not None else (int(eos_ids[0]) if eos_ids is not None else 0)
    max_new = generation_config.max_length - prompt_len
    if max_new < 1:
        raise ValueError(f"max_length {generation_config.max_length} leaves no room after the {prompt_len}-token prompt.")
    settings = resolve_settings(draft, target, generation_config, num_rows)  # this call's, never the draft's
    policy, gate = settings.policy, settings.gate
    layer_indices = hidden_state_indices(draft.config.target_layer_ids)
    stats = DSparkGenerationStats(block_size=gamma)
    record_generation_stats(draft, stats)
    warned_non_finite = False

    def process(scores: torch.Tensor) -> torch.Tensor:  # sequence-free processors: rows are independent
        return processors(input_ids[:1], scores) if processors is not None else scores

    def pick(scores: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(torch.softmax(scores, -1), 1).squeeze(-1) if do_sample else scores.argmax(-1)

    def features(outputs, width: int) -> torch.Tensor:
        return torch.cat([outputs.hidden_states[i][:, -width:] for i in layer_indices], dim=-1).to(draft.fc.weight.device)

    # Prefill: the target over the padded prompts; the draft's context gets every prompt slot.
    mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).bool()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=target.config)
    _check_sliding_window(cache, prompt_len + max_new, gamma)
    start = time.perf_counter()
    outputs = target(input_ids, attention_mask=mask.long(), position_ids=positions, cache=cache, use_cache=True,
                     output_hidden_states=layer_indices, logits_to_keep=1)
    first = pick(process(outputs.logits[:, -1].float()))
    draft_cache = draft.new_cache()
    draft.add_context(draft_cache, features(outputs, prompt_len), positions.to(draft.fc.weight.device),
                      mask.to(draft.fc.weight.device))
    stats.prefill_time = time.perf_counter() - start
    slot_mask = mask.clone()
    next_position = positions[:, -1] + 1
    generated = [[int(t)] for t in first]
    rows = list(range(num_rows))  # original index of each active row

    # EOS and length are enforced below as tokens are emitted; other criteria are checked per position.
    positional = positional_criteria(stopping_criteria, generation_config)
    clocks = [c for c in stopping_criteria or [] if type(c) is MaxTimeCriteria]
    stopped: set[int] = set()

    def check_stops(lengths_before: dict[int, int]) -> None:
        """Cuts each row at the first of its new positions where a positional criterion fires."""
        if not positional:
            return
        # Every row, finished ones included, so a criterion sees row r at index r as in plain generate.
        sequences = [torch.cat([input_ids[r], torch.tensor(generated[r], dtype=torch.long, device=device)])
                     for r in range(num_rows)]
        starts = [prompt_len + lengths_before.get(r, len(generated[r])) for r in range(num_rows)]
        for r, stop in enumerate(first_stops(positional, sequences, starts, filler=pad_id)):
            if stop is not None:
                del generated[r][stop - prompt_len:]
                stopped.add(r)

    def finished(r: int) -> bool:
        return len(generated[r]) >= max_new or generated[r][-1] in eos_set or r in stopped

    check_stops({r: 0 for r in range(num_rows)})
    block_offsets = torch.arange(gamma, device=device)
    while True:
        keep = [i for i, r in enumerate(rows) if not finished(r)]
        if not keep:
            break
        if any(bool(clock(input_ids[:1], None).any()) for clock in clocks):  # max_time: a clock, once a round
            break
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=device)
            _select_rows(cache, draft_cache, index)
            slot_mask, next_position = slot_mask[index], next_position[index]
            rows = [rows[i] for i in keep]
        active = len(rows)
        round_start = time.perf_counter()
        anchors = torch.tensor([generated[r][-1] for r in rows], device=device)
        budgets = [min(settings.max_draft_tokens, max_new - len(generated[r]) - 1) for r in rows]
        drafting = max(budgets) > 0 and (gate is None or gate.should_draft())
        lengths = [0] * active
        draft_time = serial_time = schedule_time = 0.0
        if drafting:
            t0 = time.perf_counter()
            block_ids = torch.full((active, gamma), draft.config.mask_token_id, dtype=torch.long, device=device)
            block_ids[:, 0] = anchors
            block = draft(block_ids, next_position[:, None] + block_offsets, draft_cache)
            t1 = time.perf_counter()
            sample = serial_sample(draft, block.logits, block.hidden_states, anchors, do_sample=do_sample,
                                   logits_processor=processors, prefix_ids=anchors[:, None] if processors else None)
            t2 = time.perf_counter()
            # A row whose draft distribution or confidences are not finite (float16 overflow) verifies
            # nothing this round: it offers the policy no positions. Its flag travels with the confidences.
            finite = sample.finite_rows()
            if sample.confidences is not None:
                rows_read = torch.cat([sample.confidences, finite[:, None].to(sample.confidences)], dim=1).tolist()
                fine = [bool(row[-1]) for row in rows_read]
                lengths = policy.admit_batch([row[:b] if ok else [] for row, b, ok in zip(rows_read, budgets, fine)])
            else:
                fine = finite.tolist()
                lengths = policy.admit_batch([[1.0] * b if ok else [] for b, ok in zip(budgets, fine)])
            if not all(fine):
                lengths = [k if ok else 0 for k, ok in zip(lengths, fine)]
                if not warned_non_finite:
                    warned_non_finite = True
                    logger.warning(NON_FINITE_DRAFT_WARNING)
            if eos_ids is not None:  # nothing after a drafted EOS can be emitted
                is_eos = torch.isin(sample.tokens, eos_ids).tolist()
                lengths = [next((j + 1 for j in range(k) if flags[j]), k) for k, flags in zip(lengths, is_eos)]
            t3 = time.perf_counter()
            draft_time, serial_time, schedule_time = t1 - t0, t2 - t1, t3 - t2
        width = max(lengths)
        lengths_t = torch.tensor(lengths, device=device)
        slots = torch.arange(width + 1, device=device)
        verify_ids = torch.full((active, width + 1), pad_id, dtype=torch.long, device=device)
        verify_ids[:, 0] = anchors
        if width:
            draft_tokens = sample.tokens[:, :width].to(device)
            verify_ids[:, 1:] = torch.where(slots[None, :-1] < lengths_t[:, None], draft_tokens, pad_id)
        new_valid = slots[None] <= lengths_t[:, None]
        verify_positions = next_position[:, None] + slots
        t4 = time.perf_counter()
        outputs = target(verify_ids, attention_mask=torch.cat([slot_mask, new_valid], dim=1).long(),
                         position_ids=verify_positions, cache=cache, use_cache=True,
                         output_hidden_states=layer_indices, logits_to_keep=width + 1)
        target_logits = process(outputs.logits.float().reshape(-1, outputs.logits.shape[-1])).view(active, width + 1, -1)
        if do_sample:
            draft_logits = sample.logits[:, :width].to(device) if width else None
            accepted, next_tokens = _speculative_accept(
                verify_ids[:, 1:], draft_logits, target_logits, lengths_t)
        else:
            choice = target_logits.argmax(-1)
            match = (verify_ids[:, 1:] == choice[:, :-1]) & (slots[None, :-1] < lengths_t[:, None])
            accepted = match.int().cumprod(dim=1).sum(dim=1)
            next_tokens = choice[torch.arange(active, device=device), accepted]
        # Roll back: only the anchor and the accepted draft tokens stay valid.
        kept_slots = slots[None] <= accepted[:, None]
        slot_mask = torch.cat([slot_mask, kept_slots], dim=1)
        draft.add_context(draft_cache, features(outputs, width + 1), verify_positions.to(draft.fc.weight.device),
                          kept_slots.to(draft.fc.weight.device))
        next_position = next_position + accepted + 1
        accepted_list, next_list = accepted.tolist(), next_tokens.tolist()
        lengths_before = {r: len(generated[r]) for r in rows}
        for i, r in enumerate(rows):
            emitted = verify_ids[i, 1 : 1 + accepted_list[i]].tolist() + [next_list[i]]
            eos_at = next((j for j, t in enumerate(emitted) if t in eos_set), None)
            if eos_at is not None:
                emitted = emitted[: eos_at + 1]
            generated[r].extend(emitted[: max_new - len(generated[r])])
        check_stops(lengths_before)
        verify_time = time.perf_counter() - t4
        # The scheduler's B counts admitted tokens; the padded forward's cost is charged to it.
        policy.observe_verify(active + sum(lengths), verify_time)
        # One RoundStats per row, the round's times shared among its rows.
        for k, n in zip(lengths, accepted_list):
            stats.rounds.append(RoundStats(verified=k, accepted=n, draft_time=draft_time / active,
                                           serial_time=serial_time / active, schedule_time=schedule_time / active,
                                           verify_time=verify_time / active, drafted=drafting))
        if gate is not None:
            seconds = time.perf_counter() - round_start
            if drafting:
                gate.record_drafted(sum(accepted_list) + active, seconds)
            if width == 0:
                gate.record_plain(seconds - draft_time - serial_time - schedule_time, tokens=active)
        if slot_mask.shape[1] > 32 and slot_mask.shape[1] > 2 * int(slot_mask.sum(dim=1).max()):
            slot_mask = _compact(cache, draft_cache, slot_mask)

    longest = max(len(g) for g in generated)
    out = torch.full((num_rows, prompt_len + longest), pad_id, dtype=torch.long, device=device)
    out[:, :prompt_len] = input_ids
    for r, tokens in enumerate(generated):
        out[r, prompt_len : prompt_len + len(tokens)] = torch.tensor(tokens, device=device)
    return out


__all__ = ["batched_dspark_generate", "check_batched_support", "SEQUENCE_FREE_PROCESSORS"]
