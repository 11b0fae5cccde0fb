"""Serial sampling: DSpark's light left-to-right loop over one draft block (paper eq. 4).

Position k is drawn from ``softmax(processors(U_k + B_k))`` where ``U_k`` are the backbone's base
logits and ``B_k`` the Markov head's bias from the token drawn at k-1. The loop returns the exact
logits each token was drawn from, because transformers' rejection sampling uses their softmax as the
draft distribution; any mismatch (another temperature, a missing top-k) would bias the output.
``U_k + B_k`` is added in the draft's dtype and then widened to float32, as DeepSpec does
(:func:`add_markov_bias`), so bf16 checkpoints propose exactly the tokens they were trained to.

Confidences ``c_1..c_gamma`` are computed after the loop in one batched call: ``c_k`` reads
``x_{k-1}`` (never ``x_k``), and all of ``x_0..x_{gamma-1}`` are known by then. With an
``admission`` callback (one request, the verify policy's incremental form) ``c_k`` is computed
inside the loop before ``x_k`` is drawn, and the loop stops at the policy's first refusal: positions
that will not be verified cost no Markov bias and no logits processors.

This module is the PyTorch reference path; a compiled CUDA op (:mod:`dspark_hf.decoding.cuda_ops`) replaces
the loop behind :func:`serial_sample` on CUDA tensors for the configurations it supports (greedy or
temperature-only sampling, vanilla/gated/no Markov head); ``backend=`` forces either path. With an
``admission`` callback the op path keeps the same economy: ``c_1`` is offered before the LM head or
the op runs (:func:`dspark_hf.decoding.cuda_ops.dispatch`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from ..model.heads import calibrated_confidences, confidence_logits
from ..model.draft_vocab import markov_bias, scatter_to_vocab
from ..model.modeling_dspark import DSparkDraftModel
from .serial_block import (NON_FINITE_DRAFT_WARNING, SerialSample, add_markov_bias, admitted_sample,
                           confidence_temperatures, draw_categorical, inverse_cdf_sample, position_confidence)

BACKENDS = ("auto", "reference", "cuda")


def _probabilities(logits: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)`` for sampling. A row whose softmax is NaN (its largest logit is NaN or
    infinite) becomes uniform instead of making :func:`draw_categorical` raise: the round is cut
    before such a position (:meth:`SerialSample.finite_lengths`), so
    neither it nor what is drawn from it is verified. Finite rows are unchanged (the same draw for
    the same seed)."""
    return torch.softmax(logits, dim=-1).nan_to_num_(nan=1.0)


def _is_draft_vocab_wide(draft: DSparkDraftModel, logits: torch.Tensor) -> bool:
    """Whether ``logits`` span a reduced draft vocabulary's N columns rather than the vocabulary."""
    ids = getattr(draft, "draft_vocab_ids", None)
    return ids is not None and logits.shape[-1] == ids.numel() != draft.config.vocab_size


def _may_use_cuda_op(backend: str, base_logits: torch.Tensor) -> bool:
    """Whether to ask :mod:`dspark_hf.decoding.cuda_ops` at all (CPU calls never import it)."""
    return backend == "cuda" or (backend == "auto" and base_logits.is_cuda)


class _SerialDraws:
    """One block's left-to-right state on the reference path, and the step both of its loops take.

    It holds the previous token, the Markov head's state and, with logits processors, the sequence
    they read (the prefix, then each token as it is drawn). :meth:`draw` turns position ``k``'s base
    logits into the float32 logits the token is drawn from and draws it.
    """

    def __init__(self, draft: DSparkDraftModel, hidden_states: torch.Tensor, anchor_ids: torch.LongTensor, *,
                 do_sample: bool, logits_processor: LogitsProcessorList | None, prefix_ids: torch.LongTensor | None,
                 generator: torch.Generator | None, uniforms: torch.Tensor | None,
                 vocab_ids: torch.LongTensor | None = None) -> None:
        batch, gamma = hidden_states.shape[:2]
        device = hidden_states.device
        self.draft = draft
        self.markov = draft.markov_head
        # Set (column_vocab_ids): rows are the N draft-vocabulary columns and a choice maps to its target id.
        self.vocab_ids = vocab_ids
        self.probs: torch.Tensor | None = None  # the distribution the last sampled token was drawn from
        self.hidden_states = hidden_states
        self.do_sample, self.generator, self.uniforms = do_sample, generator, uniforms
        self.processors = logits_processor if logits_processor is not None and len(logits_processor) > 0 else None
        self.prev = anchor_ids.to(device).view(batch)
        self.state = (self.markov.initial_state(batch, device, hidden_states.dtype)
                      if self.markov is not None else None)
        if self.processors is not None:  # the prefix, then room for the block's tokens
            prefix = prefix_ids.to(device)
            self.sequence = torch.cat([prefix, prefix.new_empty(batch, gamma)], dim=1)
            self.prefix_len = prefix.shape[1]

    def draw(self, k: int, base_row: torch.Tensor) -> torch.Tensor:
        """Draws position ``k`` (0-based) from its base logits ``U_k`` (R, V; R, N with ``vocab_ids``); returns the float32
        logits it was drawn from (``U_k + B_k`` after the processors). The token is ``self.prev``."""
        if self.markov is not None and self.vocab_ids is not None:  # the head's own N-wide bias
            bias, self.state = self.markov.step(self.prev, self.hidden_states[:, k], self.state)
            row = add_markov_bias(base_row, bias)
        elif self.markov is not None:
            bias, self.state = markov_bias(self.draft, self.prev, self.hidden_states[:, k], self.state)
            row = add_markov_bias(base_row, bias)
        else:
            row = base_row.float()
        if self.processors is not None:
            row = self.processors(self.sequence[:, : self.prefix_len + k], row)
        if self.do_sample and self.uniforms is not None:
            self.prev = inverse_cdf_sample(row, self.uniforms[:, k])
        elif self.do_sample:
            self.probs = _probabilities(row)
            choice = draw_categorical(self.probs, self.generator)
            self.prev = choice if self.vocab_ids is None else self.vocab_ids[choice]
        elif self.vocab_ids is not None:
            self.prev = self.vocab_ids[row.argmax(dim=-1)]
        else:
            self.prev = row.argmax(dim=-1)
        if self.processors is not None:
            self.sequence[:, self.prefix_len + k] = self.prev
        return row


def column_vocab_ids(draft: DSparkDraftModel, do_sample: bool, logits_processor: LogitsProcessorList | None, *,
                     exact_probabilities: bool = False, by_uniforms: bool = False) -> torch.LongTensor | None:
    """The reduced draft vocabulary's ids when a block can be drawn over its N columns alone, else None.

    Greedy without logits processors, the argmax of a full-vocabulary row (``-inf`` outside the
    subset) is the argmax of its N columns mapped to target ids, ties included: ``draft_vocab_ids``
    is strictly increasing (checked at load), so the first maximum is the same token either way.
    Working on N columns skips two vocabulary-wide scatters and a vocabulary-wide argmax per
    position and scatters the block's logits once at the end, which makes the shipped SmolLM2
    draft's block (N = 16,384 of V = 49,152) measurably cheaper (``benchmarks/round_overhead.py
    serial``; measured: docs/performance.md).

    Sampling draws over the N columns too when the caller verifies with the loop's own
    probabilities (``exact_probabilities``) and the processors act on each logit alone (none, or
    temperature only): a softmax over N columns sums in another order than one over the scattered
    row, so ``q`` must come from the loop, not from the softmax of the logits it hands over. Other
    processors (top-k, top-p, penalties) and draws by given uniforms keep whole-vocabulary rows.
    """
    ids = getattr(draft, "draft_vocab_ids", None)
    processors = list(logits_processor) if logits_processor is not None else []
    if ids is None:
        return None
    if not do_sample:
        return None if processors else ids
    if not exact_probabilities or by_uniforms:
        return None
    return ids if all(type(processor) is TemperatureLogitsWarper for processor in processors) else None


# Its former name: called as before (no exact_probabilities), it answers as it did.
greedy_vocab_ids = column_vocab_ids


def serial_sample(
    draft: DSparkDraftModel,
    base_logits: torch.Tensor,
    hidden_states: torch.Tensor,
    anchor_ids: torch.LongTensor,
    *,
    do_sample: bool,
    logits_processor: LogitsProcessorList | None = None,
    prefix_ids: torch.LongTensor | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    backend: str = "auto",
    admission: Callable[[float], bool] | None = None,
    max_positions: int | None = None,
    exact_probabilities: bool = False,
) -> SerialSample:
    """Draws one block of draft tokens left to right.

    Args:
        draft: the draft model (its ``markov_head`` and ``confidence_head`` are used; either may be None).
        base_logits: backbone logits ``U``, (R, gamma, V) (``draft.base_logits``), for a reduced
            draft vocabulary also (R, gamma, N) over its columns (``draft.draft_vocab_logits``); or
            ``None`` to compute them from ``hidden_states`` with the draft's LM head, which with
            ``admission`` happens only once the first position is admitted (a round that verifies
            nothing skips it). Either way the returned ``logits`` span the whole vocabulary.
        hidden_states: backbone hidden states ``h`` (final-normed), (R, gamma, d).
        anchor_ids: ``x_0``, the last accepted token, (R,).
        do_sample: draw from ``softmax(logits)`` if True (:func:`draw_categorical`), argmax otherwise.
        logits_processor: transformers processors/warpers (temperature, top-k, top-p, repetition
            penalty, ...), applied at each position to the sequence ``prefix_ids + x_1..x_{k-1}``,
            exactly as the target applies them when verifying.
        prefix_ids: the sequence so far, ending with the anchor, (R, L); needed with processors.
        generator: optional torch generator for sampling.
        uniforms: optional (R, gamma) numbers in [0, 1) to sample with: token k of row r becomes the
            inverse CDF of its distribution at ``uniforms[r, k]`` (:func:`inverse_cdf_sample`) instead
            of a :func:`draw_categorical` draw. The CUDA op always samples this way (drawing the
            uniforms with ``torch.rand`` when none are given, and returning them), so both paths fed
            the same uniforms give the same tokens, up to float rounding at a CDF boundary. Ignored
            when greedy.
        backend: ``"auto"`` (default) uses the compiled CUDA op for CUDA tensors when it supports the
            call (:func:`dspark_hf.decoding.cuda_ops.unsupported_reason`) and this PyTorch loop otherwise;
            ``"reference"`` always the loop; ``"cuda"`` always the op (``ValueError`` naming the
            reason when it cannot run the call, ``CudaOpUnavailable`` when it cannot be built).
        admission: for one request (R = 1), the verify policy's ``offer`` (see
            :meth:`dspark_hf.scheduling.policies.VerifyPolicy.start_round`): ``c_k`` (1.0 without a
            confidence head) is offered before ``x_k`` is drawn and the block ends at the first
            refusal. ``num_admitted`` of the result is the verification length.
        max_positions: offer at most this many positions (the generation's length budget).
        exact_probabilities: sampling on this loop with :func:`draw_categorical`, also return the
            distributions the tokens were drawn from (``probabilities``); the caller promises to
            verify with them, which lets the loop draw over a reduced draft vocabulary's columns
            (:func:`column_vocab_ids`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"serial_sample backend must be one of {BACKENDS}, got {backend!r}.")
    # The CUDA op takes whole-vocabulary logits; a caller's whole-vocabulary logits are drawn from as they are.
    vocab_ids = None if _may_use_cuda_op(backend, hidden_states) else column_vocab_ids(
        draft, do_sample, logits_processor, exact_probabilities=exact_probabilities, by_uniforms=uniforms is not None)
    if base_logits is not None and not _is_draft_vocab_wide(draft, base_logits):
        vocab_ids = None
    elif base_logits is not None and vocab_ids is None:
        base_logits = scatter_to_vocab(base_logits, draft.draft_vocab_ids, draft.config.vocab_size, float("-inf"))
    if base_logits is None and admission is None:
        base_logits = draft.base_logits(hidden_states) if vocab_ids is None else draft.draft_vocab_logits(hidden_states)
    batch, gamma = hidden_states.shape[:2]
    markov, confidence = draft.markov_head, draft.confidence_head
    use_processors = logits_processor is not None and len(logits_processor) > 0
    if use_processors and prefix_ids is None:
        raise ValueError("serial_sample needs prefix_ids when logits processors are given.")
    if not do_sample:
        uniforms = None
    elif uniforms is not None and tuple(uniforms.shape) != (batch, gamma):
        raise ValueError(f"uniforms must have shape (R, gamma) = {(batch, gamma)}, got {tuple(uniforms.shape)}.")
    if admission is not None and batch != 1:
        raise ValueError(f"serial_sample admission decides one request; got {batch} rows (use admit_batch).")
    keep_probabilities = do_sample and exact_probabilities and uniforms is None
    num_positions = gamma if max_positions is None else max(0, min(gamma, max_positions))
    if _may_use_cuda_op(backend, hidden_states):
        # Imported here, not at the top: CPU-only runs never load the op's module (it registers the
        # operator with torch.library on import). cuda_ops does not import this module back.
        from .cuda_ops import dispatch

        # With admission, the op path keeps the early stop and the lazy LM head (see cuda_ops._draw_admitted).
        result = dispatch(draft, base_logits, hidden_states, anchor_ids, do_sample=do_sample,
                          logits_processor=logits_processor, generator=generator, uniforms=uniforms,
                          backend=backend, admission=admission, num_positions=num_positions)
        if result is not None:
            return result
    if admission is not None:
        return _sample_admitted(draft, base_logits, hidden_states, anchor_ids, do_sample=do_sample,
                                logits_processor=logits_processor, prefix_ids=prefix_ids, generator=generator,
                                uniforms=uniforms, admission=admission, num_positions=num_positions,
                                vocab_ids=vocab_ids, keep_probabilities=keep_probabilities)

    draws = _SerialDraws(draft, hidden_states, anchor_ids, do_sample=do_sample, logits_processor=logits_processor,
                         prefix_ids=prefix_ids, generator=generator, uniforms=uniforms, vocab_ids=vocab_ids)
    tokens = torch.empty(batch, gamma, dtype=torch.long, device=hidden_states.device)
    if markov is None:  # the base logits are what is drawn from: one float32 copy of the block, filled in place
        logits = base_logits.float()
        if logits.data_ptr() == base_logits.data_ptr():  # never write into the caller's tensor
            logits = logits.clone()
        base = logits
    else:  # filled position by position with U_k + B_k (see add_markov_bias)
        base = base_logits
        logits = torch.empty(base_logits.shape, dtype=torch.float32, device=base_logits.device)
    probabilities = torch.empty_like(logits) if keep_probabilities else None
    for k in range(gamma):
        row = draws.draw(k, base[:, k])
        if row.data_ptr() != logits[:, k].data_ptr():  # a view of `logits` already holds it
            logits[:, k] = row
        if probabilities is not None:
            probabilities[:, k] = draws.probs
        tokens[:, k] = draws.prev
    if vocab_ids is not None:
        logits = scatter_to_vocab(logits, vocab_ids, draft.config.vocab_size, float("-inf"))
        if probabilities is not None:
            probabilities = scatter_to_vocab(probabilities, vocab_ids, draft.config.vocab_size, 0.0)

    confidences = None
    if confidence is not None:
        previous = torch.cat([anchor_ids.view(batch, 1).to(tokens.device), tokens[:, :-1]], dim=1)
        temperatures = confidence_temperatures(draft, tokens.device)
        confidences = calibrated_confidences(confidence_logits(draft, hidden_states, previous),
                                             None if temperatures is None else temperatures[:gamma])
    return SerialSample(tokens=tokens, logits=logits, confidences=confidences,
                        uniforms=uniforms.to(device=tokens.device, dtype=torch.float32) if uniforms is not None else None,
                        probabilities=probabilities)


def _sample_admitted(draft, base_logits, hidden_states, anchor_ids, *, do_sample, logits_processor, prefix_ids,
                     generator, uniforms, admission, num_positions, vocab_ids, keep_probabilities) -> SerialSample:
    """The loop for one request that asks the policy before drawing each token."""
    has_confidence = draft.confidence_head is not None
    device = hidden_states.device
    temperatures = confidence_temperatures(draft, device) if has_confidence else None
    draws = _SerialDraws(draft, hidden_states, anchor_ids, do_sample=do_sample, logits_processor=logits_processor,
                         prefix_ids=prefix_ids, generator=generator, uniforms=uniforms, vocab_ids=vocab_ids)
    head = draft.base_logits if vocab_ids is None else draft.draft_vocab_logits
    first = 0  # position of base_logits[:, 0]
    lm_head_seconds = 0.0
    tokens, logits, offered, probabilities = [], [], [], []
    for k in range(num_positions):
        c = position_confidence(draft, hidden_states, k, draws.prev, temperatures)
        offered.append(c)
        if not admission(c):
            break
        if base_logits is None:  # first admitted position: one LM-head call for the rest of the block
            start = time.perf_counter()
            base_logits, first = head(hidden_states[:, k:num_positions]), k
            lm_head_seconds = time.perf_counter() - start
        logits.append(draws.draw(k, base_logits[:, k - first]))
        tokens.append(draws.prev)
        if keep_probabilities:
            probabilities.append(draws.probs)
    logits = torch.stack(logits, dim=1) if tokens else None
    probabilities = torch.stack(probabilities, dim=1) if probabilities else None
    if logits is not None and vocab_ids is not None:
        logits = scatter_to_vocab(logits, vocab_ids, draft.config.vocab_size, float("-inf"))
        if probabilities is not None:
            probabilities = scatter_to_vocab(probabilities, vocab_ids, draft.config.vocab_size, 0.0)
    return admitted_sample(
        torch.stack(tokens, dim=1) if tokens else None, logits, offered,
        has_confidence=has_confidence, uniforms=uniforms, lm_head_seconds=lm_head_seconds,
        vocab_size=draft.config.vocab_size, device=device, probabilities=probabilities)


# SerialSample, NON_FINITE_DRAFT_WARNING, add_markov_bias and inverse_cdf_sample live in
# dspark_hf.decoding.serial_block (shared with the CUDA op) and are offered here too, where callers find them.
__all__ = ["BACKENDS", "NON_FINITE_DRAFT_WARNING", "SerialSample", "add_markov_bias", "column_vocab_ids",
           "inverse_cdf_sample", "serial_sample"]
