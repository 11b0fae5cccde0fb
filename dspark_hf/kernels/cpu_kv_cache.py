"""CPU fast path, cache part: a step's keys and values written in place instead of concatenated.

transformers' ``DynamicLayer.update`` appends a step's keys and values with ``torch.cat``, which copies
the whole cached tensor of the layer every step: a step costs time in proportion to the context it
already has. For SmolLM2-135M in float32 on a 256-token context that was the largest op outside the
kernels (``aten::cat``, 620 calls in 10 steps, under ``torch.profiler``), and at 2,000 tokens of
context it copies about 95 MB a step.

:func:`append_to_cache` keeps each layer's keys and values in a buffer with room to spare and writes
the new tokens after the cached ones; the layer's ``keys`` and ``values`` are views of the filled
part, so everything else transformers does with the cache works unchanged (``crop`` shortens the
views, ``get_seq_length`` reads their shape; ``batch_select_indices``, ``reorder_cache`` or any code
that assigns new tensors simply starts a fresh buffer at the next step). When the room runs out a
buffer a quarter larger (at least :data:`SPARE_TOKENS` more) takes its place, so the copying is
amortised over many steps. The numbers stored are the same; only the strides of the key and value
tensors handed to attention change, and the lean decoder's probe checks that outputs stay equal bit
for bit before it uses this (:mod:`dspark_hf.kernels.cpu_decoder`). Where the compiled CPU extension is
loaded, one call checks and writes both and returns the views (``csrc/cpu_kv_append.cpp``); from Python
the checks and four ops cost about as much as the concatenation on a short context.

It runs only inside the lean forward (no gradients) and only on plain ``DynamicLayer`` layers of a
cache that is not offloaded; every other layer type goes through its own ``update``. Tokens cut off
by ``crop`` are overwritten by the next step's: a tensor taken from the cache before a crop and kept
after it (no code in transformers or dspark_hf does this) would see them change.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import cpu_extension

SPARE_TOKENS = 256
"""The least room a new buffer leaves after the tokens it holds."""

_BUFFERS_ATTRIBUTE = "_dspark_kv_buffers"  # (key buffer, value buffer) on the DynamicLayer


def append_to_cache(cache: DynamicCache, key_states: torch.Tensor, value_states: torch.Tensor,
                    layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.update(key_states, value_states, layer_idx)`` with the same results, writing the new tokens
    into spare room instead of concatenating (see the module docstring). Returns the layer's keys and
    values, ``(batch, heads, length, head_dim)`` views of its buffers."""
    layers = cache.layers
    replicate = getattr(cache, "layer_class_to_replicate", None)  # a cache made without a config adds layers
    while replicate is not None and len(layers) <= layer_idx:  # as it is first updated (as Cache.update does)
        layers.append(replicate())
    if getattr(cache, "offloading", False) or layer_idx >= len(layers) or type(layers[layer_idx]) is not DynamicLayer:
        return cache.update(key_states, value_states, layer_idx)
    layer = layers[layer_idx]
    buffers = layer.__dict__.get(_BUFFERS_ATTRIBUTE)
    kernels = cpu_extension.loaded_extension()
    if buffers is not None and kernels is not None:
        # The common step in one compiled call: its checks fail (None) where the layer no longer holds views of
        # its buffers, the buffers are full, or the new tensors do not match them; the checked path then decides.
        filled = kernels.append_key_value(layer.keys, layer.values, *buffers, key_states, value_states)
        if filled is not None:
            layer.keys, layer.values = filled
            return filled
    return _append_checked(layer, key_states, value_states)


def _append_checked(layer: DynamicLayer, key_states: torch.Tensor,
                    value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not layer.is_initialized:
        layer.lazy_initialization(key_states, value_states)
    keys, values = layer.keys, layer.values
    if not (_appendable(keys, key_states) and _appendable(values, value_states)):
        return layer.update(key_states, value_states)  # what torch.cat makes of it (or its error)
    length = keys.shape[-2] if keys.dim() == 4 else 0
    end = length + key_states.shape[-2]
    buffers = layer.__dict__.get(_BUFFERS_ATTRIBUTE)
    if buffers is None or not (_is_leading_view(keys, buffers[0], end) and _is_leading_view(values, buffers[1], end)):
        buffers = (_fresh_buffer(keys, key_states, end), _fresh_buffer(values, value_states, end))
        layer.__dict__[_BUFFERS_ATTRIBUTE] = buffers
    for buffer, new in zip(buffers, (key_states, value_states)):
        buffer.narrow(2, length, new.shape[-2]).copy_(new)
    layer.keys, layer.values = (buffer.narrow(2, 0, end) for buffer in buffers)
    return layer.keys, layer.values


def _appendable(stored: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether torch.cat along dim -2 would join these without promotion: an empty cache, or the same
    batch, heads, head dim, dtype and device."""
    if new.dim() != 4 or stored.dtype != new.dtype or stored.device != new.device:
        return False
    if stored.dim() != 4:
        return stored.numel() == 0  # lazy_initialization's empty tensor
    return stored.shape[0] == new.shape[0] and stored.shape[1] == new.shape[1] and stored.shape[3] == new.shape[3]


def _is_leading_view(stored: torch.Tensor, buffer: torch.Tensor, end: int) -> bool:
    """Whether ``stored`` is ``buffer[:, :, :length]`` (what this module left there, possibly cropped since)
    and the buffer has room up to ``end``."""
    return (stored.dim() == 4 and end <= buffer.shape[2] and stored.data_ptr() == buffer.data_ptr()
            and stored.stride() == buffer.stride() and stored.shape[0] == buffer.shape[0]
            and stored.shape[1] == buffer.shape[1] and stored.shape[3] == buffer.shape[3])


def _fresh_buffer(stored: torch.Tensor, new: torch.Tensor, end: int) -> torch.Tensor:
    """A buffer with room for ``end`` tokens and more, holding ``stored``'s."""
    capacity = end + max(SPARE_TOKENS, end // 4)
    buffer = new.new_empty((new.shape[0], new.shape[1], capacity, new.shape[3]))
    if stored.dim() == 4 and stored.shape[2]:
        buffer.narrow(2, 0, stored.shape[2]).copy_(stored)
    return buffer


__all__ = ["SPARE_TOKENS", "append_to_cache"]
