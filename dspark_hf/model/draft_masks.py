"""Attention masks of the draft layers: full layers, and speculators' sliding-window layers.

A draft block ``[x0, MASK, ...]`` at anchor position ``p`` attends to keys ``[context; block]``.

* ``"full_attention"`` layers (every DeepSpec, z-lab and dspark_hf draft so far): all real context
  tokens and the whole block (no causal mask). The mask is ``None`` unless the context has padding,
  or the caller (training) passes its own.
* ``"sliding_attention"`` layers (vllm-project/speculators' default DSpark draft): the last
  ``config.sliding_window`` real context tokens only (context positions ``p - W .. p - 1``; the
  window is counted from the anchor for the whole block, as speculators' training mask
  ``create_anchor_block_mask_mod`` does), and with ``config.sliding_block_causal`` only the block
  positions up to the query's own (speculators' ``sliding_window_non_causal = False``).

The context cache holds exactly the tokens before the anchor, each real one once (padding and
rejected slots are marked in ``key_mask``), so "the last W real keys" is the window whatever the
cache's slot layout (batched compaction moves slots but keeps their order).
"""

from __future__ import annotations

import torch

__all__ = ["layer_attention_masks", "sliding_layer_indices", "sliding_window_mask"]


def sliding_layer_indices(config) -> list[int]:
    """Indices of the draft layers that are ``"sliding_attention"`` (empty for the default layout)."""
    types = list(getattr(config, "layer_types", None) or [])[: config.num_hidden_layers]
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"]


def sliding_window_mask(key_mask: torch.Tensor | None, context_len: int, batch: int, block_len: int, window: int,
                        causal: bool, device) -> torch.Tensor:
    """Boolean mask (R, 1, block_len, context_len + block_len) of a sliding-window layer (True = attend).

    Args:
        key_mask: (R, context_len) bool, False for padding/rejected slots; ``None`` when all are real.
        window: number of real context tokens before the anchor the block sees.
        causal: whether a block position sees only the block positions up to its own.
    """
    real = key_mask.to(device=device, dtype=torch.bool) if key_mask is not None else \
        torch.ones(1, context_len, dtype=torch.bool, device=device)
    # Real keys at or after each slot; a key is inside the window when at most `window` of them remain.
    remaining = real.flip(-1).long().cumsum(-1).flip(-1)
    context = real & (remaining <= window)
    block = torch.ones(block_len, block_len, dtype=torch.bool, device=device)
    if causal:
        block = block.tril()
    rows = max(batch, context.shape[0])
    context = context[:, None, :].expand(rows, block_len, context_len)
    return torch.cat([context, block.expand(rows, block_len, block_len)], dim=-1)[:, None]


def layer_attention_masks(config, attention_mask: torch.Tensor | None, cache, input_shape: tuple[int, int],
                          device) -> list[torch.Tensor | None]:
    """One mask per draft layer for a forward over blocks of ``input_shape`` (R, block tokens).

    Full layers get ``attention_mask`` when given (training's packed blocks), else the padding mask
    of the cached context (``None`` when every token is real), exactly as before sliding layers
    existed. Sliding layers get :func:`sliding_window_mask`; they cannot take a caller's mask,
    because the window needs each block's anchor, which a packed training mask does not carry.
    """
    batch, block_len = input_shape
    key_mask = cache.key_mask if cache is not None else None
    full = attention_mask
    if full is None and key_mask is not None:
        block = torch.ones(input_shape, dtype=torch.bool, device=device)
        full = torch.cat([key_mask, block], dim=1)[:, None, None, :]
    sliding = sliding_layer_indices(config)
    if not sliding:
        return [full] * config.num_hidden_layers
    if attention_mask is not None:
        raise ValueError(
            f"This draft has sliding_attention layers {sliding} (sliding_window={config.sliding_window}); their mask "
            "is built from the context cache at inference, and training them on packed blocks is not implemented in "
            "dspark_hf. Train such drafts with vllm-project/speculators, or use full_attention layers."
        )
    keys = cache.keys[0] if cache is not None and cache.keys else None
    context_len = 0 if keys is None else keys.shape[2]
    windowed = sliding_window_mask(key_mask, context_len, batch, block_len, int(config.sliding_window),
                                   bool(config.sliding_block_causal), device)
    return [windowed if i in sliding else full for i in range(config.num_hidden_layers)]
