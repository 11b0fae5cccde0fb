"""The draft's context cache: per-layer keys and values of the target features of accepted tokens."""

from __future__ import annotations

import torch

from .. import kv_buffers


class DraftContextCache:
    """Per-layer keys/values of the draft's context (target features of accepted tokens).

    Only context lives here: a round appends the newly accepted tokens and the block's own
    keys/values are never stored, so rollback is implicit. ``key_mask`` marks real (non-padding)
    context tokens and is ``None`` while every token is real.

    Outside autograd the keys and values live in buffers with spare room
    (:mod:`dspark_hf.kv_buffers`): an append writes the new tokens behind the context, and a draft
    forward writes its block there too (:meth:`with_block`, past the stored length, so the next append
    overwrites it) instead of concatenating a copy of the whole context in every layer. ``keys[i]`` and
    ``values[i]`` are views of the filled part; code that assigns other tensors to them (batched decoding
    compacting rows) simply starts fresh buffers at the next append. With gradients on (training) it
    concatenates, as an in-place write would break backward.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.key_mask: torch.Tensor | None = None
        self.length = 0
        self._buffers: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * num_layers

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores a layer's keys and values of new context tokens behind the ones it holds."""
        self.keys[layer_idx], self.values[layer_idx] = self._joined(layer_idx, keys, values)

    def with_block(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's context keys and values followed by a block's, which are not stored: ``torch.cat`` of the
        two along the sequence (the block's alone while the cache is empty)."""
        stored_keys, stored_values = self.keys[layer_idx], self.values[layer_idx]
        if stored_keys is None:
            return keys, values
        joined_keys, joined_values = self._joined(layer_idx, keys, values)
        key_buffer = self._buffers[layer_idx][0]
        in_buffer = key_buffer is not None and joined_keys.data_ptr() == key_buffer.data_ptr()
        if in_buffer and stored_keys.data_ptr() != key_buffer.data_ptr():
            # The block did not fit: the context moved into a larger buffer with it, so point there (the next
            # append then writes in place rather than copying the context once more).
            length = stored_keys.shape[2]
            self.keys[layer_idx], self.values[layer_idx] = joined_keys[:, :, :length], joined_values[:, :, :length]
        return joined_keys, joined_values

    def _joined(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stored_keys, stored_values = self.keys[layer_idx], self.values[layer_idx]
        recording = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (stored_keys, stored_values, keys, values))
        joined = None if recording else kv_buffers.append_pair(
            (stored_keys, stored_values), self._buffers[layer_idx], (keys, values))
        if joined is None:
            if stored_keys is None:
                return keys, values
            return torch.cat([stored_keys, keys], dim=2), torch.cat([stored_values, values], dim=2)
        (joined_keys, joined_values), self._buffers[layer_idx] = joined
        return joined_keys, joined_values

    def append_mask(self, mask: torch.Tensor | None, num_new: int, batch_size: int, device) -> None:
        """Records which of the ``num_new`` appended tokens are real; ``mask`` None means all."""
        if mask is None and self.key_mask is None:
            return
        if mask is None:
            mask = torch.ones(batch_size, num_new, dtype=torch.bool, device=device)
        if self.key_mask is None:
            self.key_mask = torch.ones(batch_size, self.length, dtype=torch.bool, device=device)
        self.key_mask = torch.cat([self.key_mask, mask.to(device=device, dtype=torch.bool)], dim=1)


__all__ = ["DraftContextCache"]
