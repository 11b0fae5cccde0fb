"""CPU fast path, cache part: a step's keys and values written in place instead of concatenated.

transformers' ``DynamicLayer.update`` appends a step's keys and values with ``torch.cat``, which copies
the whole cached tensor of the layer every step: a step costs time in proportion to the context it
already has (SmolLM2-135M in float32 at 2,048 tokens: 30 layers x keys and values x 3 heads x 2,048 x 64
x 4 bytes, 94 MB copied a step).

:func:`append_to_cache` keeps each layer's keys and values in buffers with room to spare
(:mod:`dspark_hf.kv_buffers`); the layer's ``keys`` and ``values`` are views of the filled part,
so everything else transformers does with the cache works unchanged (``crop`` shortens the views,
``get_seq_length`` reads their shape; ``batch_select_indices``, ``reorder_cache`` or any code that
assigns new tensors simply starts fresh buffers at the next step). The numbers stored are the same; only
the strides of the key and value tensors handed to attention change, and the lean decoder's probe checks
that outputs stay equal bit for bit before it uses this (:mod:`dspark_cpu.decoder`). Where the
compiled CPU extension is loaded, one call checks and writes both and returns the views
(``csrc/cpu_kv_append.cpp``); from Python the checks and four ops cost as much as the concatenation on a
256-token context. Compiled, it takes a few percent off steps at 256 to 2,048 tokens of context
(``benchmarks/kv_append.py``; measured: docs/performance.md).

It runs only inside the lean forward (no gradients) and only on plain ``DynamicLayer`` layers of a
cache that is not offloaded; every other layer type goes through its own ``update``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import extension
from dspark_hf.kv_buffers import append_pair

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
    kernels = extension.loaded_extension()
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
    joined = append_pair((layer.keys, layer.values), layer.__dict__.get(_BUFFERS_ATTRIBUTE, (None, None)),
                         (key_states, value_states))
    if joined is None:
        return layer.update(key_states, value_states)  # what torch.cat makes of it (or its error)
    (layer.keys, layer.values), layer.__dict__[_BUFFERS_ATTRIBUTE] = joined
    return layer.keys, layer.values


__all__ = ["append_to_cache"]
