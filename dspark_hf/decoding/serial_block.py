"""What the two serial-sampling paths share: the PyTorch loop (:mod:`dspark_hf.decoding.sampling`) and the
compiled CUDA op (:mod:`dspark_hf.decoding.cuda_ops`).

Both return a :class:`SerialSample`, compute a position's confidence the same way
(:func:`position_confidence`, with the calibration temperatures of :func:`confidence_temperatures`),
add the Markov bias with DeepSpec's arithmetic (:func:`add_markov_bias`) and, when given uniforms,
sample by the same inverse-CDF rule (:func:`inverse_cdf_sample`). :func:`draw_categorical` is the
one-draw-per-row sampler DSpark's loops use (on CPU in place of ``torch.multinomial``). Keeping these here lets the
sampling module call into the op and the op use them without the two modules importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.heads import calibrated_confidences, confidence_logits

__all__ = [
    "NON_FINITE_DRAFT_WARNING",
    "SerialSample",
    "add_markov_bias",
    "admitted_sample",
    "confidence_temperatures",
    "draw_categorical",
    "inverse_cdf_sample",
    "position_confidence",
]


@dataclass
class SerialSample:
    """Result of :func:`~dspark_hf.decoding.sampling.serial_sample`.

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
        probabilities: with ``exact_probabilities`` on a sampled reference loop that drew with
            :func:`draw_categorical`, the very distributions the tokens were drawn from, (R, gamma, V)
            float32 (zero outside a reduced draft vocabulary); a verification must use these as ``q``
            (their softmax-of-``logits`` twin can differ in the last bit when the loop drew over a
            reduced vocabulary's columns). ``None`` otherwise.
    """

    tokens: torch.LongTensor
    logits: torch.Tensor
    confidences: torch.Tensor | None
    uniforms: torch.Tensor | None = None
    num_admitted: int | None = None
    lm_head_seconds: float = 0.0  # wall time of a lazily computed LM head (part of the draft forward)
    offered: list[float] | None = None  # with admission: the confidences offered, as Python floats
    probabilities: torch.Tensor | None = None

    def finite_lengths(self) -> torch.Tensor:
        """(R,) long on the sample's device: how many leading drawn positions of each row had a
        well-defined distribution and a finite confidence. A round verifies at most that many.

        A distribution is well defined when the largest logit is finite: a NaN or ``+inf`` logit
        (float16 overflow, corrupt weights) or a row of ``-inf`` makes its softmax NaN, while a
        partial ``-inf`` mask (top-k, top-p) is fine. Position ``k``'s logits and confidence are
        functions of ``x_0..x_{k-1}`` only, so where the first non-finite position falls is decided
        by tokens drawn before it: cutting there keeps "``x_k`` is verified" independent of ``x_k``
        and later tokens. (Dropping the whole round instead would let ``x_k`` decide, through
        position ``k + 1``, whether ``x_k`` is verified: a biased sample.) One max-reduction over
        the logits already computed; no host sync (the caller reads it with its own transfer).
        """
        width = self.tokens.shape[1]
        ok = torch.isfinite(self.logits[:, :width].amax(dim=-1))
        if self.confidences is not None:
            ok &= torch.isfinite(self.confidences[:, :width]).to(ok.device)
        return ok.long().cumprod(dim=1).sum(dim=1)

    def finite_rows(self) -> torch.Tensor:
        """(R,) bool: True where every drawn position of the row is finite (see :meth:`finite_lengths`)."""
        return self.finite_lengths() == self.tokens.shape[1]


def admitted_sample(tokens: torch.LongTensor | None, logits: torch.Tensor | None, offered: list[float], *,
                    has_confidence: bool, uniforms: torch.Tensor | None, lm_head_seconds: float,
                    vocab_size: int, device: torch.device,
                    probabilities: torch.Tensor | None = None) -> SerialSample:
    """The :class:`SerialSample` of one request decided by the policy's ``admission``: both paths
    (the reference loop and the CUDA op's) build it here, so they set the same fields.

    Args:
        tokens, logits: the admitted ``x_1..x_keep`` (1, keep) and the logits they were drawn from
            (1, keep, V); ``None`` when nothing was admitted.
        offered: every confidence offered to the policy, the refused one included (1.0 each
            without a confidence head); the generation loop reads its last value to warn about a
            non-finite confidence.
        has_confidence: whether the draft has a confidence head (else ``confidences`` is None).
        uniforms: the numbers the tokens were drawn with, or None.
        lm_head_seconds: wall time of the lazily run LM head.
        vocab_size, device: the shape and place of the empty result when nothing was admitted.
        probabilities: the distributions the admitted tokens were drawn from (1, keep, V), or None.
    """
    if tokens is None:
        tokens = torch.empty(1, 0, dtype=torch.long, device=device)
        logits = torch.empty(1, 0, vocab_size, device=device)
        probabilities = None
    return SerialSample(
        tokens=tokens,
        logits=logits,
        confidences=torch.tensor([offered], dtype=torch.float32, device=device) if has_confidence else None,
        uniforms=uniforms.to(device=device, dtype=torch.float32) if uniforms is not None else None,
        num_admitted=tokens.shape[1],
        lm_head_seconds=lm_head_seconds,
        offered=offered,
        probabilities=probabilities,
    )


# Logged (once per generate call) when a round's draft distribution is not finite.
NON_FINITE_DRAFT_WARNING = (
    "The draft produced non-finite logits or confidences (NaN or inf: float16 overflow or corrupt weights); "
    "such rounds verify only the draft tokens before the first non-finite position (none when it is the "
    "first), which keeps the output exactly the target's (greedy) or distributed as the target's (sampling), "
    "but those rounds gain less speed. Run the draft in bfloat16 or float32, or check its weights. Logged "
    "once per generate call."
)


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


def draw_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """One draw per row of ``probs`` (R, V), non-negative weights, each row with a finite positive sum
    (``ValueError`` otherwise, as ``torch.multinomial`` raises):
    the distribution of ``torch.multinomial(probs, 1)``, by the inverse CDF at a float64 uniform.

    Why not ``torch.multinomial``: on CPU it draws V exponential variates per row (the
    exponential-race trick), while a cumulative sum and a binary search cost a fraction of that
    (measured: docs/performance.md); the serial loop draws at every draft position and
    the batched loop for every row each round. The sum runs in float64 and the uniform has 53 random
    bits, so every token's probability is matched to float64 rounding (a zero weight is never drawn,
    because the search returns the first index whose cumulative sum exceeds the target). Off the CPU
    it is ``torch.multinomial`` itself (a fused GPU kernel; checking rows on the host would wait
    for the device every draw).
    """
    if probs.device.type != "cpu":  # a fused kernel there, and checking the rows would wait for the device
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    totals = cdf[:, -1]
    if not bool(((totals > 0) & torch.isfinite(totals)).all()):
        # torch.multinomial refuses these rows too; drawing from them would invent a token.
        raise ValueError("Cannot sample: a row of probabilities is not finite or sums to 0 (the model produced "
                         "NaN or infinite logits). Check the model's weights and dtype (float16 overflows).")
    uniforms = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device, generator=generator)
    tokens = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def confidence_temperatures(draft, device: torch.device | str) -> torch.Tensor | None:
    """The draft config's calibration temperatures as a float32 tensor on ``device`` (``None`` when
    uncalibrated).

    Cached on the draft per value and device, so a round makes no host-to-device copy (which also
    lets CUDA-op calls be captured in a CUDA graph once the cache is warm); a change of
    ``config.confidence_temperatures`` (recalibration) is picked up on the next call.
    """
    temperatures = draft.config.confidence_temperatures
    if temperatures is None:
        return None
    key = (tuple(float(t) for t in temperatures), str(device))
    cache = getattr(draft, "_dspark_temperature_cache", None)
    if cache is None or cache[0] != key:
        cache = (key, torch.tensor(key[0], dtype=torch.float32, device=device))
        try:
            draft._dspark_temperature_cache = cache
        except AttributeError:  # a draft that refuses attributes: build it each call
            pass
    return cache[1]


def position_confidence(draft, hidden_states: torch.Tensor, k: int, prev: torch.LongTensor,
                        temperatures: torch.Tensor | None) -> float:
    """``c_{k+1}`` of one request (draft position ``k``, 0-based) from its hidden state and the
    previous token ``prev`` (1,), calibrated when ``temperatures`` are given; 1.0 without a
    confidence head. It never reads the token drawn at position ``k``."""
    if draft.confidence_head is None:
        return 1.0
    logits = confidence_logits(draft, hidden_states[:, k : k + 1], prev.view(1, 1))
    return float(calibrated_confidences(logits, None if temperatures is None else temperatures[k : k + 1]))
