"""Sampled verification: speculative sampling (Leviathan et al.) for the rounds of both loops.

:func:`speculative_accept` keeps each proposed token with probability ``min(1, p/q)`` and draws
the token after the last kept one from ``norm(max(0, p - q))`` (after a rejection) or ``p`` (after
a full acceptance). It serves the batched loop directly and, through
:func:`verify_sampled_round`, transformers' batch-1 loop.

Why batch 1 needs it: transformers' ``_assisted_decoding`` verifies a sampled round in its module
function ``_speculative_sampling`` when the candidate generator returns logits, and otherwise draws
*every* position from the target with ``torch.multinomial`` and keeps the matching prefix. On CPU
``torch.multinomial`` draws V exponential variates per row, so a 10-token context-lookup copy paid
more for drawing than half a SmolLM2 step (measured: docs/performance.md). Inside a DSpark call (:func:`dspark_sampled_verification`)
the candidate generator therefore returns logits for every sampled round (a point mass for a lookup
copy, empty ones for a plain step and for the prefill's token) and :func:`install_sampled_verification` routes
``_speculative_sampling`` to :func:`verify_sampled_round`: the same rule, one draw per round
(:func:`~dspark_hf.decoding.serial_block.draw_categorical`, a tenth of the cost). Outside a DSpark
call transformers' own function runs, unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

import torch
import transformers.generation.utils as generation_utils
from transformers.utils import logging

from .serial_block import draw_categorical

logger = logging.get_logger(__name__)

class _DSparkCall:
    """What one batch-1 DSpark generate call handed transformers this round, for the verification:
    a lookup copy's point mass (its shape), so that verifying it skips a softmax of one-hot rows
    (a vocabulary-wide pass per copied token), or the exact distributions the drafted
    tokens were drawn from (the serial loop may have drawn them over a reduced vocabulary's columns,
    where the softmax of the logits can differ in the last bit; and recomputing it would cost a
    vocabulary-wide softmax per position). Set when the round's logits are made and forgotten when
    the next round begins (:func:`begin_round`); the verification matches them to the logits
    transformers passes back by shape, because transformers moves those to the target's device."""

    __slots__ = ("point_mass_shape", "probabilities")

    def __init__(self) -> None:
        self.point_mass_shape: torch.Size | None = None
        self.probabilities: torch.Tensor | None = None


# Set while this thread (or task) runs a batch-1 DSpark generate call; transformers' own assisted
# generation (another assistant, prompt lookup alone) elsewhere keeps transformers' function.
_DSPARK_CALL: contextvars.ContextVar[_DSparkCall | None] = contextvars.ContextVar("dspark_sampled_verification",
                                                                                   default=None)
_MARKER = "_dspark_sampled_verification"
_EXPECTED_PARAMETERS = ("candidate_input_ids", "candidate_logits", "candidate_length", "new_logits")


def speculative_accept(proposed: torch.LongTensor, lengths: torch.Tensor, target_logits: torch.Tensor,
                       draft_logits: torch.Tensor | None, draft_rows: torch.Tensor | None,
                       draft_probabilities: torch.Tensor | None = None):
    """Per-row speculative sampling (Leviathan et al.).

    Args:
        proposed: the proposed tokens, (R, K); row r proposes its first ``lengths[r]``.
        lengths: (R,).
        target_logits: the target's processed logits at the anchor and every proposed slot, (R, K + 1, V).
        draft_logits: the exact logits the drafted rows' tokens were drawn from, (D, K_d, V).
        draft_rows: which rows those are, (D,). Every other row's proposal is deterministic (a
            context-lookup copy): ``q`` is one-hot at its token.
        draft_probabilities: the exact distributions the drafted tokens were drawn from, (D, K_d, V)
            (:attr:`~dspark_hf.decoding.serial_block.SerialSample.probabilities`); when given they are
            ``q`` and ``draft_logits`` is not read.

    Returns:
        (accepted ``n_r``, next token) per row. Position k is kept with probability
        ``min(1, p/q)``; after a rejection the next token comes from ``norm(max(0, p - q))``, which
        for a one-hot ``q`` is ``p`` without the rejected token; after a full acceptance from ``p``.
    """
    rows, width = proposed.shape
    p = torch.softmax(target_logits, dim=-1)
    if width == 0:
        return torch.zeros(rows, dtype=torch.long, device=p.device), draw_categorical(p[:, 0])
    row_index = torch.arange(rows, device=p.device)
    p_tok = p[:, :width].gather(-1, proposed[..., None]).squeeze(-1)
    q_tok = torch.ones_like(p_tok)
    drafted = draft_rows is not None and draft_rows.numel() > 0
    if drafted:
        q = torch.softmax(draft_logits, dim=-1) if draft_probabilities is None else draft_probabilities
        drafted_width = min(width, q.shape[1])
        q_tok[draft_rows, :drafted_width] = q[:, :drafted_width].gather(
            -1, proposed[draft_rows, :drafted_width, None]).squeeze(-1)
    # u < p/q without dividing by 0; strict, so a token the target gives probability 0 is never kept.
    accept = torch.rand(rows, width, device=p.device) * q_tok < p_tok
    accept &= torch.arange(width, device=p.device)[None] < lengths[:, None]
    accepted = accept.int().cumprod(dim=1).sum(dim=1)
    p_next = p[row_index, accepted]
    at = accepted.clamp(max=width - 1)
    q_next = torch.zeros_like(p_next).scatter_(-1, proposed[row_index, at][:, None], 1.0)
    if drafted:
        q_next[draft_rows] = q[torch.arange(draft_rows.numel(), device=p.device),
                               accepted[draft_rows].clamp(max=drafted_width - 1)]
    residual = (p_next - q_next).clamp(min=0)
    residual_sum = residual.sum(-1, keepdim=True)
    use_residual = (accepted < lengths)[:, None] & (residual_sum > 0)
    distribution = torch.where(use_residual, residual / residual_sum.clamp(min=1e-30), p_next)
    return accepted, draw_categorical(distribution)


def point_mass_logits(tokens: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """Logits (1, K, V) whose softmax is one-hot at each of ``tokens`` (K,): the exact distribution
    of a deterministic proposal (a context-lookup copy), so it is verified by the sampling rule
    (keep with probability ``p(x)``, else draw from ``p`` without ``x``), which transformers'
    ``_speculative_sampling`` also computes correctly from them. Inside a DSpark call the verification
    recognises these very logits and treats the proposal as deterministic without a softmax."""
    logits = torch.full((1, tokens.shape[0], vocab_size), float("-inf"), device=tokens.device)
    logits.scatter_(-1, tokens.view(1, -1, 1), 0.0)
    call = _DSPARK_CALL.get()
    if call is not None:
        call.point_mass_shape = logits.shape
    return logits


def begin_round() -> None:
    """Forgets what an earlier round of this DSpark call handed over, so a round reads only its own
    (called by the candidate generator before it proposes anything)."""
    call = _DSPARK_CALL.get()
    if call is not None:
        call.point_mass_shape = call.probabilities = None


def hand_over_drafted(logits: torch.Tensor, probabilities: torch.Tensor | None) -> torch.Tensor:
    """Returns ``logits`` (the drafted tokens' logits handed to transformers) after noting, inside a
    DSpark call, the exact distributions they were drawn from, which the verification then uses as ``q``."""
    call = _DSPARK_CALL.get()
    if call is not None:
        call.probabilities = probabilities
    return logits


def verify_sampled_round(candidate_input_ids: torch.LongTensor, candidate_logits: torch.Tensor,
                         candidate_length: int, new_logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
    """transformers' ``_speculative_sampling`` contract for one sequence, by :func:`speculative_accept`.

    Args:
        candidate_input_ids: the sequence with the ``candidate_length`` proposed tokens at its end, (1, L).
        candidate_logits: the logits the proposal was drawn from, (1, candidate_length, V)
            (a point mass for a lookup copy; ``candidate_length`` 0 for a plain step).
        new_logits: the target's processed logits at the anchor and each proposed token, (1, candidate_length + 1, V).

    Returns:
        ``(valid tokens (1, n + 1), n)``: the ``n`` kept proposal tokens and the drawn next one.
    """
    proposed = candidate_input_ids[:, candidate_input_ids.shape[1] - candidate_length:]
    lengths = torch.full((1,), candidate_length, dtype=torch.long, device=proposed.device)
    call = _DSPARK_CALL.get()
    point_mass = call is not None and call.point_mass_shape == candidate_logits.shape
    probabilities = None
    if call is not None and call.probabilities is not None and call.probabilities.shape == candidate_logits.shape:
        probabilities = call.probabilities.to(candidate_logits.device)
    drafted = candidate_length > 0 and not point_mass  # a point mass is speculative_accept's deterministic row
    draft_rows = torch.zeros(1, dtype=torch.long, device=proposed.device) if drafted else None
    accepted, next_token = speculative_accept(proposed, lengths, new_logits, candidate_logits if drafted else None,
                                              draft_rows, probabilities if drafted else None)
    n_matches = int(accepted[0])
    return torch.cat([proposed[:, :n_matches], next_token.view(1, 1)], dim=1), accepted[0]


def sampled_verification_active() -> bool:
    """Whether :func:`verify_sampled_round` verifies this thread's sampled batch-1 rounds now."""
    return _DSPARK_CALL.get() is not None and is_sampled_verification_installed()


@contextlib.contextmanager
def dspark_sampled_verification():
    """Marks a batch-1 DSpark generate call, so its sampled rounds are verified by :func:`verify_sampled_round`."""
    token = _DSPARK_CALL.set(_DSparkCall())
    try:
        yield
    finally:
        _DSPARK_CALL.reset(token)


def install_sampled_verification() -> None:
    """Routes transformers' ``_speculative_sampling`` to :func:`verify_sampled_round` inside DSpark
    calls (idempotent). A transformers whose function has another signature keeps its own, with
    the draws it makes (logged once): the results are the same, only slower."""
    original = getattr(generation_utils, "_speculative_sampling", None)
    if original is None or getattr(original, _MARKER, False):
        return
    if tuple(inspect.signature(original).parameters)[:4] != _EXPECTED_PARAMETERS:
        logger.warning(
            "transformers' _speculative_sampling has an unexpected signature; DSpark's sampled rounds keep "
            "transformers' verification (same distribution, slower draws on CPU).")
        return

    @functools.wraps(original)
    def _speculative_sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, *args, **kwargs):
        lossy = args or any(value is not None for value in kwargs.values())  # e.g. assistant_ensemble_weight
        if _DSPARK_CALL.get() is None or lossy or candidate_input_ids.shape[0] != 1:
            return original(candidate_input_ids, candidate_logits, candidate_length, new_logits, *args, **kwargs)
        return verify_sampled_round(candidate_input_ids, candidate_logits, candidate_length, new_logits)

    setattr(_speculative_sampling, _MARKER, True)
    _speculative_sampling.__wrapped_original__ = original
    generation_utils._speculative_sampling = _speculative_sampling


def is_sampled_verification_installed() -> bool:
    """Whether transformers' ``_speculative_sampling`` is routed (inside DSpark calls) to :func:`verify_sampled_round`."""
    return getattr(getattr(generation_utils, "_speculative_sampling", None), _MARKER, False)


__all__ = [
    "begin_round",
    "dspark_sampled_verification",
    "hand_over_drafted",
    "install_sampled_verification",
    "is_sampled_verification_installed",
    "point_mass_logits",
    "sampled_verification_active",
    "speculative_accept",
    "verify_sampled_round",
]
