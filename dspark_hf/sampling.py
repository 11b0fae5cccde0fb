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

This module is the PyTorch reference path; a compiled CUDA op (:mod:`dspark_hf.cuda_ops`) replaces
the loop behind :func:`serial_sample` on CUDA tensors for the configurations it supports (greedy or
temperature-only sampling, vanilla/gated/no Markov head); ``backend=`` forces either path. With an
``admission`` callback the op path keeps the same economy: ``c_1`` is offered before the LM head or
the op runs (:func:`dspark_hf.cuda_ops.dispatch_admitted`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from .draft_vocab import markov_bias
from .modeling_dspark import DSparkDraftModel


@dataclass
class SerialSample:
    """Result of :func:`serial_sample`.

    Attributes:
        tokens: drawn tokens ``x_1..x_gamma``, (R, gamma) long; with ``admission``, only the
            admitted ``x_1..x_keep`` (R = 1, keep = ``num_admitted``).
        logits: the float32 logits each token was drawn from (``U_k + B_k`` after the logits
            processors), (R, gamma, V); with ``admission``, (1, keep, V).
        confidences: ``c_1..c_gamma`` (calibrated when the config has temperatures), (R, gamma)
            float32, or ``None`` for a draft without a confidence head; with ``admission``, the
            ones offered to it.
        uniforms: when sampling by inverse CDF (the CUDA op always, the reference when given
            ``uniforms``), the numbers in [0, 1) the tokens were drawn with, (R, gamma) float32;
            otherwise ``None``.
    """

    tokens: torch.LongTensor
    logits: torch.Tensor
    confidences: torch.Tensor | None
    uniforms: torch.Tensor | None = None
    num_admitted: int | None = None
    lm_head_seconds: float = 0.0  # wall time of a lazily computed LM head (part of the draft forward)
    offered: list[float] | None = None  # with admission: the confidences offered, as Python floats

    def finite_rows(self) -> torch.Tensor:
        """(R,) bool on the sample's device: True where every drawn position of the row had a
        well-defined distribution and a finite confidence.

        A distribution is well defined when the largest logit is finite: a NaN or ``+inf`` logit
        (float16 overflow, corrupt weights) or a row of ``-inf`` makes its softmax NaN, while a
        partial ``-inf`` mask (top-k, top-p) is fine. One max-reduction over the logits already
        computed; no host sync (the caller reads the flags with its own transfer).
        """
        ok = torch.isfinite(self.logits.amax(dim=-1)).all(dim=-1)
        if self.confidences is not None:
            ok &= torch.isfinite(self.confidences[:, : self.tokens.shape[1]]).all(dim=-1).to(ok.device)
        return ok


# Logged (once per generate call) when a round's draft distribution is not finite; the round verifies nothing.
NON_FINITE_DRAFT_WARNING = (
    "The draft produced non-finite logits or confidences (NaN or inf: float16 overflow or corrupt weights); "
    "rounds where that happens verify no draft tokens, so the output stays the target's but those rounds "
    "gain no speed. Run the draft in bfloat16 or float32, or check its weights. Logged once per generate call."
)


def _probabilities(logits: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)`` for multinomial sampling. A row whose softmax is NaN (its largest logit is
    NaN or infinite) becomes uniform instead of making ``torch.multinomial`` raise (or, on CUDA,
    assert): such a row is flagged by :meth:`SerialSample.finite_rows` and never verified, so what
    is drawn from it does not matter. Finite rows are unchanged (the same draw for the same seed)."""
    return torch.softmax(logits, dim=-1).nan_to_num_(nan=1.0)


BACKENDS = ("auto", "reference", "cuda")


def _may_use_cuda_op(backend: str, base_logits: torch.Tensor) -> bool:
    """Whether to ask :mod:`dspark_hf.cuda_ops` at all (CPU calls never import it)."""
    return backend == "cuda" or (backend == "auto" and base_logits.is_cuda)


def add_markov_bias(base_logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``U_k + B_k`` as DeepSpec computes it, as float32: the sum is taken in the draft's dtype
    (for a bf16 draft it is rounded to bf16) and only then widened for the logits processors and
    sampling. The drafts were trained with this arithmetic; adding in float32 instead changes the
    argmax wherever rounding makes a near-tie (about a fifth of 7-token blocks at V = 151,936). In
    float32 both orders are the same. (Mixed dtypes follow PyTorch's promotion.)"""
    return (base_logits + bias).float()


def inverse_cdf_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.LongTensor:
    """Draws from ``softmax(logits)`` (R, V) at ``uniforms`` (R,) in [0, 1): the smallest v with
    ``sum_{i <= v} p_i > u`` (computed in float64). The CUDA op samples by the same rule."""
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(dim=-1)
    target = uniforms.to(device=logits.device, dtype=torch.float64).reshape(-1, 1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return tokens.clamp_(max=logits.shape[-1] - 1)


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
) -> SerialSample:
    """Draws one block of draft tokens left to right.

    Args:
        draft: the draft model (its ``markov_head`` and ``confidence_head`` are used; either may be None).
        base_logits: backbone logits ``U``, (R, gamma, V); or ``None`` to compute them from
            ``hidden_states`` with the draft's LM head, which with ``admission`` happens only
            once the first position is admitted (a round that verifies nothing skips it).
        hidden_states: backbone hidden states ``h`` (final-normed), (R, gamma, d).
        anchor_ids: ``x_0``, the last accepted token, (R,).
        do_sample: multinomial sampling if True, argmax otherwise.
        logits_processor: transformers processors/warpers (temperature, top-k, top-p, repetition
            penalty, ...), applied at each position to the sequence ``prefix_ids + x_1..x_{k-1}``,
            exactly as the target applies them when verifying.
        prefix_ids: the sequence so far, ending with the anchor, (R, L); needed with processors.
        generator: optional torch generator for sampling.
        uniforms: optional (R, gamma) numbers in [0, 1) to sample with: token k of row r becomes the
            inverse CDF of its distribution at ``uniforms[r, k]`` (:func:`inverse_cdf_sample`) instead
            of a ``torch.multinomial`` draw. The CUDA op always samples this way (drawing the
            uniforms with ``torch.rand`` when none are given, and returning them), so both paths fed
            the same uniforms give the same tokens, up to float rounding at a CDF boundary. Ignored
            when greedy.
        backend: ``"auto"`` (default) uses the compiled CUDA op for CUDA tensors when it supports the
            call (:func:`dspark_hf.cuda_ops.unsupported_reason`) and this PyTorch loop otherwise;
            ``"reference"`` always the loop; ``"cuda"`` always the op (``ValueError`` naming the
            reason when it cannot run the call, ``CudaOpUnavailable`` when it cannot be built).
        admission: for one request (R = 1), the verify policy's ``offer`` (see
            :meth:`dspark_hf.scheduler.VerifyPolicy.start_round`): ``c_k`` (1.0 without a
            confidence head) is offered before ``x_k`` is drawn and the block ends at the first
            refusal. ``num_admitted`` of the result is the verification length.
        max_positions: offer at most this many positions (the generation's length budget).
    """
    if backend not in BACKENDS:
        raise ValueError(f"serial_sample backend must be one of {BACKENDS}, got {backend!r}.")
    if base_logits is None and admission is None:
        base_logits = draft.base_logits(hidden_states)
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
    num_positions = gamma if max_positions is None else max(0, min(gamma, max_positions))
    if _may_use_cuda_op(backend, hidden_states):
        from .cuda_ops import dispatch, dispatch_admitted

        if admission is None:
            result = dispatch(draft, base_logits, hidden_states, anchor_ids, do_sample=do_sample,
                              logits_processor=logits_processor, generator=generator, uniforms=uniforms,
                              backend=backend)
        else:  # keeps the early stop and the lazy LM head (see dispatch_admitted)
            result = dispatch_admitted(draft, base_logits, hidden_states, anchor_ids, do_sample=do_sample,
                                       logits_processor=logits_processor, generator=generator, uniforms=uniforms,
                                       backend=backend, admission=admission, num_positions=num_positions)
        if result is not None:
            return result
    if admission is not None:
        return _sample_admitted(draft, base_logits, hidden_states, anchor_ids, do_sample=do_sample,
                                logits_processor=logits_processor, prefix_ids=prefix_ids, generator=generator,
                                uniforms=uniforms, admission=admission, num_positions=num_positions)

    tokens = torch.empty(batch, gamma, dtype=torch.long, device=base_logits.device)
    if markov is None:
        logits = base_logits.float()  # a fresh float32 copy when the backbone runs in half precision
        if logits.data_ptr() == base_logits.data_ptr():
            logits = logits.clone()
    else:  # filled position by position with U_k + B_k (see add_markov_bias)
        logits = torch.empty(base_logits.shape, dtype=torch.float32, device=base_logits.device)
    if use_processors:
        sequence = torch.cat([prefix_ids.to(base_logits.device), tokens], dim=1)
        prefix_len = prefix_ids.shape[1]

    prev = anchor_ids.to(base_logits.device)
    state = markov.initial_state(batch, hidden_states.device, hidden_states.dtype) if markov is not None else None
    for k in range(gamma):
        if markov is not None:
            bias, state = markov_bias(draft, prev, hidden_states[:, k], state)
            logits[:, k] = add_markov_bias(base_logits[:, k], bias)
        if use_processors:
            logits[:, k] = logits_processor(sequence[:, : prefix_len + k], logits[:, k])
        if do_sample and uniforms is not None:
            prev = inverse_cdf_sample(logits[:, k], uniforms[:, k])
        elif do_sample:
            prev = torch.multinomial(_probabilities(logits[:, k]), num_samples=1, generator=generator).squeeze(1)
        else:
            prev = logits[:, k].argmax(dim=-1)
        tokens[:, k] = prev
        if use_processors:
            sequence[:, prefix_len + k] = prev

    confidences = None
    if confidence is not None:
        prev_tokens = torch.cat([anchor_ids.view(batch, 1).to(tokens.device), tokens[:, :-1]], dim=1)
        prev_features = markov.markov_w1(prev_tokens) if confidence.with_markov else None
        conf_logits = confidence.logits(hidden_states, prev_features).float()
        temperatures = _confidence_temperatures(draft, conf_logits.device)
        if temperatures is not None:
            conf_logits = conf_logits / temperatures[:gamma]
        confidences = torch.sigmoid(conf_logits)
    return SerialSample(tokens=tokens, logits=logits, confidences=confidences,
                        uniforms=uniforms.to(device=tokens.device, dtype=torch.float32) if uniforms is not None else None)


def _confidence_temperatures(draft: DSparkDraftModel, device) -> torch.Tensor | None:
    temperatures = draft.config.confidence_temperatures
    return None if temperatures is None else torch.tensor(temperatures, device=device, dtype=torch.float32)


def position_confidence(draft: DSparkDraftModel, hidden_states: torch.Tensor, k: int, prev: torch.LongTensor,
                        temperatures: torch.Tensor | None) -> float:
    """``c_{k+1}`` of one request (draft position ``k``, 0-based) from its hidden state and the
    previous token ``prev`` (1,), calibrated when ``temperatures`` are given; 1.0 without a
    confidence head. It never reads the token drawn at position ``k``."""
    confidence = draft.confidence_head
    if confidence is None:
        return 1.0
    prev_features = draft.markov_head.markov_w1(prev)[:, None] if confidence.with_markov else None
    conf_logit = confidence.logits(hidden_states[:, k : k + 1], prev_features).float()
    if temperatures is not None:
        conf_logit = conf_logit / temperatures[k]
    return float(torch.sigmoid(conf_logit))


def _sample_admitted(draft, base_logits, hidden_states, anchor_ids, *, do_sample, logits_processor, prefix_ids,
                     generator, uniforms, admission, num_positions) -> SerialSample:
    """The loop for one request that asks the policy before drawing each token."""
    markov, confidence = draft.markov_head, draft.confidence_head
    use_processors = logits_processor is not None and len(logits_processor) > 0
    device = hidden_states.device
    temperatures = _confidence_temperatures(draft, device) if confidence is not None else None
    sequence = prefix_ids.to(device) if use_processors else None
    first = 0  # position of base_logits[:, 0]
    lm_head_seconds = 0.0
    prev = anchor_ids.to(device).view(1)
    state = markov.initial_state(1, hidden_states.device, hidden_states.dtype) if markov is not None else None
    tokens, logits, offered = [], [], []
    for k in range(num_positions):
        c = position_confidence(draft, hidden_states, k, prev, temperatures)
        offered.append(c)
        if not admission(c):
            break
        if base_logits is None:  # first admitted position: one LM-head call for the rest of the block
            start = time.perf_counter()
            base_logits, first = draft.base_logits(hidden_states[:, k:num_positions]), k
            lm_head_seconds = time.perf_counter() - start
        row = base_logits[:, k - first]
        if markov is not None:
            bias, state = markov_bias(draft, prev, hidden_states[:, k], state)
            row = add_markov_bias(row, bias)
        row = row.float()
        if use_processors:
            row = logits_processor(sequence, row)
        if do_sample and uniforms is not None:
            prev = inverse_cdf_sample(row, uniforms[:, k])
        elif do_sample:
            prev = torch.multinomial(_probabilities(row), num_samples=1, generator=generator).squeeze(1)
        else:
            prev = row.argmax(dim=-1)
        tokens.append(prev)
        logits.append(row)
        if use_processors:
            sequence = torch.cat([sequence, prev.view(1, 1)], dim=1)
    keep = len(tokens)
    vocab = draft.config.vocab_size
    return SerialSample(
        tokens=torch.stack(tokens, dim=1) if keep else torch.empty(1, 0, dtype=torch.long, device=device),
        logits=torch.stack(logits, dim=1) if keep else torch.empty(1, 0, vocab, device=device),
        confidences=torch.tensor([offered], dtype=torch.float32, device=device) if confidence is not None else None,
        uniforms=uniforms.to(device=device, dtype=torch.float32) if uniforms is not None else None,
        num_admitted=keep,
        lm_head_seconds=lm_head_seconds,
        offered=offered,
    )


__all__ = ["BACKENDS", "NON_FINITE_DRAFT_WARNING", "SerialSample", "add_markov_bias", "inverse_cdf_sample",
           "serial_sample"]
