"""A reduced draft vocabulary: the draft proposes only N chosen target tokens (EAGLE-3 / FR-Spec style).

A draft with ``config.draft_vocab_size = N`` stores ``draft_vocab_ids``: N target token ids, int64,
sorted and unique, saved in ``model.safetensors`` (a persistent buffer). Its logits are computed on
that subset only: the LM head's rows are gathered by these ids (the gathered copy is cached per bound
head and never saved) and the Markov head's ``markov_w2`` is ``Linear(rank, N)``. ``markov_w1`` stays
vocabulary-wide, because it embeds the previous token, which may be any target token.

Lossless by construction: generation scatters the N-wide logits back to the full vocabulary with
``-inf`` outside the subset (and the Markov bias with 0, so the sum stays ``-inf`` there). The draft
therefore gives probability exactly zero to every other token, the logits handed to transformers'
rejection sampling are the distribution the token was drawn from, and a token outside the subset is
produced by the residual distribution when the target wants it. Everything downstream (logits
processors, the CUDA op, the scheduler) sees full-vocabulary tensors as before; only the serial loop
draws over the N columns and scatters the block once, where that changes nothing
(:func:`~dspark_hf.decoding.sampling.column_vocab_ids`: greedy without processors, the same argmax
since the ids are sorted; sampling when the caller verifies with the loop's own probabilities).
The CUDA kernels need no change: they receive the scattered logits and a vocabulary-wide ``W2``
with zero rows outside the subset (:func:`full_vocab_markov_w2`).

This module is runtime code: validation of the ids, the gathered head, and the scatters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..engine_hooks import pack_like

BUFFER_NAME = "draft_vocab_ids"


def draft_vocab_problem(ids: torch.Tensor | None, vocab_size: int, draft_vocab_size: int | None) -> str | None:
    """What is wrong with ``ids`` as the draft vocabulary of a ``vocab_size`` target for a config
    declaring ``draft_vocab_size`` (a sentence), or None when they fit.

    Valid: a 1-D integer tensor of ``draft_vocab_size`` ids in ``[0, vocab_size)``, strictly
    increasing (sorted, no repeats). One host read of three flags for the value checks.
    """
    if draft_vocab_size is None:
        return None if ids is None else (
            f"it holds {BUFFER_NAME} ({tuple(ids.shape)}) but config.json has no draft_vocab_size")
    if ids is None:
        return f"config.json sets draft_vocab_size={draft_vocab_size} but the weights have no {BUFFER_NAME}"
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
        return f"{BUFFER_NAME} must be a 1-D int64 tensor, got dtype {ids.dtype} and shape {tuple(ids.shape)}"
    if ids.numel() != draft_vocab_size:
        return f"{BUFFER_NAME} holds {ids.numel()} ids but config.json sets draft_vocab_size={draft_vocab_size}"
    if ids.device.type == "meta":
        return f"{BUFFER_NAME} has no values (meta device)"
    if ids.numel() == 0:
        return None
    low, high = torch.aminmax(ids)
    increasing = (ids[1:] > ids[:-1]).all() if ids.numel() > 1 else torch.tensor(True)
    low, high, increasing = torch.stack([low.cpu(), high.cpu(), increasing.cpu().long()]).tolist()
    if low < 0 or high >= vocab_size:
        return f"{BUFFER_NAME} has ids in [{low}, {high}], outside the vocabulary [0, {vocab_size})"
    if not increasing:
        return f"{BUFFER_NAME} must be sorted with no repeats (strictly increasing)"
    return None


def check_draft_vocab_ids(ids: torch.Tensor | None, vocab_size: int, draft_vocab_size: int | None,
                          where: str = "This draft") -> None:
    """Raises ``ValueError`` naming the problem and the fix when :func:`draft_vocab_problem` finds one."""
    problem = draft_vocab_problem(ids, vocab_size, draft_vocab_size)
    if problem is not None:
        raise ValueError(
            f"{where} has a broken reduced draft vocabulary: {problem}. A reduced draft needs both "
            f"draft_vocab_size in config.json and the matching {BUFFER_NAME} tensor (N sorted unique target ids) "
            "in its weights; a full-vocabulary draft has neither. Re-save the draft with dspark_hf "
            "(draft.save_pretrained) or re-download it."
        )


def as_draft_vocab_ids(ids, vocab_size: int) -> torch.LongTensor:
    """``ids`` (any integer sequence or tensor) as a sorted int64 CPU tensor; ``ValueError`` for
    repeats or ids outside ``[0, vocab_size)``."""
    tensor = torch.as_tensor(ids).detach().to("cpu")
    if tensor.is_floating_point() or tensor.dim() != 1 or tensor.numel() == 0:
        raise ValueError(f"draft_vocab_ids must be a non-empty 1-D sequence of token ids, got shape "
                         f"{tuple(tensor.shape)} and dtype {tensor.dtype}.")
    tensor = tensor.long().sort().values
    check_draft_vocab_ids(tensor, vocab_size, tensor.numel(), "draft_vocab_ids")
    return tensor


def check_loaded_draft_vocab(model: nn.Module, missing: set[str], unexpected: set[str], mismatched: list,
                             where: str) -> list:
    """Checks a just-loaded draft's reduced vocabulary (``from_pretrained``); raises ``ValueError``
    naming the problem and the fix.

    Removes :data:`BUFFER_NAME` from ``missing``/``unexpected`` (in place) and returns ``mismatched``
    without it, so the generic key check reports only the other weights. A full-vocabulary draft
    (DeepSpec, z-lab, ours without the field) has neither the config field nor the tensor.
    """
    size = model.config.draft_vocab_size
    saved_shape = next((tuple(saved) for key, saved, _ in mismatched if key == BUFFER_NAME), None)
    if BUFFER_NAME in unexpected:
        problem = f"the weights hold {BUFFER_NAME} but config.json has no draft_vocab_size"
    elif BUFFER_NAME in missing:
        problem = draft_vocab_problem(None, model.config.vocab_size, size)
    elif saved_shape is not None:
        problem = f"{BUFFER_NAME} has shape {saved_shape} but config.json sets draft_vocab_size={size}"
    else:
        problem = draft_vocab_problem(getattr(model, BUFFER_NAME, None), model.config.vocab_size, size)
    if problem is not None:
        raise ValueError(
            f"Checkpoint {where} has a broken reduced draft vocabulary: {problem}. A reduced draft needs both "
            f"draft_vocab_size (N) in config.json and the {BUFFER_NAME} tensor (N sorted unique target ids, int64) "
            "in its weights; a full-vocabulary draft has neither. Re-save the draft with dspark_hf "
            "(draft.save_pretrained), re-download it, or fix config.json to match the weights."
        )
    missing.discard(BUFFER_NAME)
    unexpected.discard(BUFFER_NAME)
    return [entry for entry in mismatched if entry[0] != BUFFER_NAME]


class _SingleEntryCache:
    """Holds one derived tensor with the key it was built for (source pointers, versions, device,
    dtype), so a bound head that is replaced, moved, cast or updated in place is gathered again."""

    __slots__ = ("key", "value")

    def __init__(self):
        self.key, self.value = None, None

    def get(self, key: tuple, build):
        if self.key != key:
            self.value, self.key = build(), key
        return self.value


def _tensor_key(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tensor._version, str(tensor.device), tensor.dtype, tuple(tensor.shape))


def gathered_head(head: nn.Module, ids: torch.LongTensor, cache: _SingleEntryCache,
                  dtype: torch.dtype | None = None, prepared: bool = True) -> nn.Linear:
    """A frozen ``nn.Linear`` holding the rows ``ids`` of ``head`` (weight and bias), cached in ``cache``.

    ``dtype`` (default: the head's) casts the rows once, for a matmul that runs in a lower precision than the
    head is stored in (training under autocast, :func:`subset_logits`); a cast copy is a plain ``nn.Linear``,
    since an engine prepares a head for the dtype it is stored in. ``prepared=False`` keeps the rows a plain
    ``nn.Linear`` too: training multiplies hundreds of rows at once, where the stock matmul beats the CPU
    engine's kernels made for decoding's few rows (measured: docs/training.md).

    It runs the way ``head`` runs: when an engine prepared ``head`` (the CPU engine's ``optimize_for_cpu``
    packs it), the gathered layer is prepared the same way through the engine's packing hook
    (:func:`dspark_hf.engine_hooks.pack_like`). Without this the
    reduced head would take the stock multi-row CPU path that the fast path exists to avoid (a
    16,384-row subset of SmolLM2's head then cost more per draft round than the packed full head).
    """
    weight, bias = head.weight, getattr(head, "bias", None)
    dtype = weight.dtype if dtype is None else dtype

    def build():
        # Outside inference mode even when called inside it: an inference tensor cannot be packed
        # (packing tracks the weight's version) nor reused outside inference mode later.
        with torch.inference_mode(False), torch.no_grad():
            # Built on the meta device: a random init of the N rows only to overwrite them was a
            # visible delay in the first admitted round (measured: docs/performance.md).
            rows = nn.Linear(weight.shape[1], ids.numel(), bias=bias is not None, device="meta", dtype=dtype)
            rows.weight = nn.Parameter(weight.index_select(0, ids.to(weight.device)).to(dtype), requires_grad=False)
            if bias is not None:
                rows.bias = nn.Parameter(bias.index_select(0, ids.to(bias.device)).to(dtype), requires_grad=False)
            return pack_like(head, rows) if prepared and dtype == weight.dtype else rows

    key = (_tensor_key(weight), _tensor_key(ids), None if bias is None else _tensor_key(bias), type(head), dtype,
           prepared)
    return cache.get(key, build)


def subset_logits(head: nn.Module, hidden_states: torch.Tensor, ids: torch.LongTensor,
                  cache: _SingleEntryCache, prepared: bool = True) -> torch.Tensor:
    """Logits of the subset ``ids`` only, ``(..., N)``: ``hidden_states @ head.weight[ids].T`` (+ bias).

    A head being trained (gradients recorded) is gathered each call so its gradient reaches the full
    weight; a frozen one runs from :func:`gathered_head`. Under autocast (a draft trained in bfloat16) the
    frozen rows are cast to autocast's dtype once, not at every call as autocast would, and the matmul runs
    in that dtype even where an engine packed the head for its stored dtype. ``prepared``: as in
    :func:`gathered_head` (False in training).
    """
    if torch.is_grad_enabled() and head.weight.requires_grad:
        weight = head.weight
        bias = getattr(head, "bias", None)
        if bias is not None:
            bias = bias.index_select(0, ids.to(bias.device))
        return F.linear(hidden_states.to(weight.device, weight.dtype), weight.index_select(0, ids.to(weight.device)),
                        bias)
    rows = gathered_head(head, ids, cache, _matmul_dtype(head.weight, hidden_states.device), prepared)
    return rows(hidden_states.to(rows.weight.device, rows.weight.dtype))


def _matmul_dtype(weight: torch.Tensor, device: torch.device) -> torch.dtype:
    if weight.is_floating_point() and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return weight.dtype


def scatter_to_vocab(values: torch.Tensor, ids: torch.LongTensor, vocab_size: int, fill: float) -> torch.Tensor:
    """``values`` (..., N) placed at columns ``ids`` of a (..., vocab_size) tensor filled with ``fill``
    (``-inf`` for logits, 0 for the Markov bias)."""
    full = values.new_full((*values.shape[:-1], vocab_size), fill)
    # scatter_, not index_copy_ (the same for unique ids): the faster of the two for a draft-vocabulary
    # row on CPU (benchmarks/op_costs.py; measured: docs/performance.md).
    return full.scatter_(-1, ids.to(values.device, torch.long).expand(values.shape), values)


def full_vocab_markov_w2(markov_w2: torch.Tensor, ids: torch.LongTensor, vocab_size: int,
                         cache: _SingleEntryCache) -> torch.Tensor:
    """The N-wide ``markov_w2`` (N, r) as a vocabulary-wide (V, r) weight with zero rows outside
    ``ids``, for the CUDA op (whose kernels take a full-vocabulary W2); cached, never saved."""

    def build():
        with torch.no_grad():
            rows = markov_w2.new_zeros(vocab_size, markov_w2.shape[1])
            return rows.index_copy_(0, ids.to(markov_w2.device), markov_w2)

    return cache.get((_tensor_key(markov_w2), _tensor_key(ids), vocab_size), build)


def markov_bias(draft, prev_tokens: torch.Tensor, hidden: torch.Tensor, state):
    """The Markov head's bias for one position over the whole vocabulary, and its new state: the
    head's own (R, V) output, or for a reduced draft vocabulary its (R, N) output placed at
    ``draft_vocab_ids`` with 0 elsewhere (where the base logits are ``-inf``)."""
    bias, state = draft.markov_head.step(prev_tokens, hidden, state)
    ids = getattr(draft, BUFFER_NAME, None)
    if ids is not None:
        bias = scatter_to_vocab(bias, ids, draft.config.vocab_size, 0.0)
    return bias, state


def cuda_op_markov_w2(draft) -> torch.Tensor:
    """The ``W2`` the CUDA op reads: ``markov_w2.weight``, padded to the whole vocabulary with zero
    rows for a reduced draft vocabulary (cached on the draft; the kernels are unchanged)."""
    weight = draft.markov_head.markov_w2.weight
    ids = getattr(draft, BUFFER_NAME, None)
    if ids is None:
        return weight
    return full_vocab_markov_w2(weight, ids, draft.config.vocab_size, draft._draft_vocab_caches[1])


def new_cache() -> _SingleEntryCache:
    """An empty cache for :func:`gathered_head` / :func:`full_vocab_markov_w2`."""
    return _SingleEntryCache()


__all__ = ["BUFFER_NAME", "as_draft_vocab_ids", "check_draft_vocab_ids", "check_loaded_draft_vocab",
           "cuda_op_markov_w2", "draft_vocab_problem", "full_vocab_markov_w2", "gathered_head",
           "markov_bias", "new_cache", "scatter_to_vocab", "subset_logits"]
