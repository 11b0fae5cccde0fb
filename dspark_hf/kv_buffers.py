"""Keys and values kept in buffers with spare room, so that appending tokens writes them instead of copying the cache.

A cache that grows by ``torch.cat`` copies everything it holds at every append: a decoding step then costs
time in proportion to the context it already has. Here the tokens live in a buffer
``(batch, heads, capacity, head_dim)`` and the cache holds a view of its filled part; appending writes behind
it, and only when the room runs out does a buffer a quarter larger (at least :data:`SPARE_TOKENS` more) take
its place, so the copying is amortised over many appends. The stored numbers are those ``torch.cat`` would
give; only the strides of the views differ. Users: the target's cache in the lean decoder
(the CPU engine's ``dspark_cpu.kv_cache``) and the draft's context cache
(:class:`dspark_hf.model.draft_context_cache.DraftContextCache`).

Positions past a view's end may be overwritten by the next write: a view taken before a cache was cut back and
kept after it would see them change (no code in transformers or dspark_hf does this).
"""

from __future__ import annotations

import torch

SPARE_TOKENS = 256
"""The least room a new buffer leaves after the tokens it holds."""


def joinable(stored: torch.Tensor | None, new: torch.Tensor) -> bool:
    """Whether ``torch.cat([stored, new], dim=2)`` would join these without type promotion: nothing stored yet
    (None or an empty placeholder), or the same batch, heads, head dim, dtype and device."""
    if new.dim() != 4:
        return False
    if stored is None:
        return True
    if stored.dtype != new.dtype or stored.device != new.device:
        return False
    if stored.dim() != 4:
        return stored.numel() == 0
    return stored.shape[0] == new.shape[0] and stored.shape[1] == new.shape[1] and stored.shape[3] == new.shape[3]


def stored_length(stored: torch.Tensor | None) -> int:
    return stored.shape[2] if stored is not None and stored.dim() == 4 else 0


def is_leading_view(stored: torch.Tensor | None, buffer: torch.Tensor | None, end: int) -> bool:
    """Whether ``stored`` is ``buffer[:, :, :length]`` (what a write left there, possibly cut back since) and the
    buffer has room up to ``end``."""
    return (stored is not None and buffer is not None and stored.dim() == 4 and end <= buffer.shape[2]
            and stored.data_ptr() == buffer.data_ptr() and stored.stride() == buffer.stride()
            and stored.shape[0] == buffer.shape[0] and stored.shape[1] == buffer.shape[1]
            and stored.shape[3] == buffer.shape[3])


def write_behind(stored: torch.Tensor | None, buffer: torch.Tensor | None,
                 new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: ``new`` written behind ``stored`` (which must be :func:`joinable` with it), in
    ``buffer`` where ``stored`` is its leading view and it has room, else in a fresh, larger buffer that
    starts with a copy of ``stored``. ``view`` is the buffer's filled part, equal to ``torch.cat([stored, new],
    dim=2)``."""
    length = stored_length(stored)
    end = length + new.shape[2]
    if not is_leading_view(stored, buffer, end):
        capacity = end + max(SPARE_TOKENS, end // 4)
        buffer = new.new_empty((new.shape[0], new.shape[1], capacity, new.shape[3]))
        if length:
            buffer.narrow(2, 0, length).copy_(stored)
    buffer.narrow(2, length, new.shape[2]).copy_(new)
    return buffer.narrow(2, 0, end), buffer


def append_pair(stored: tuple[torch.Tensor | None, torch.Tensor | None],
                buffers: tuple[torch.Tensor | None, torch.Tensor | None],
                new: tuple[torch.Tensor, torch.Tensor]) -> tuple[tuple, tuple] | None:
    """Keys and values ``new`` written behind ``stored`` (:func:`write_behind` for each): ``((keys, values),
    (key buffer, value buffer))``, or None where either pair is not :func:`joinable` (the caller concatenates,
    or lets ``torch.cat`` raise its error)."""
    if not (joinable(stored[0], new[0]) and joinable(stored[1], new[1])):
        return None
    keys, key_buffer = write_behind(stored[0], buffers[0], new[0])
    values, value_buffer = write_behind(stored[1], buffers[1], new[1])
    return (keys, values), (key_buffer, value_buffer)


__all__ = ["SPARE_TOKENS", "append_pair", "joinable", "write_behind"]
