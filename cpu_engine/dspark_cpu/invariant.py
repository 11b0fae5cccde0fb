"""Batch-invariant verification on CPU: a verify forward of k tokens gives every token the logits of a
one-token step, bit for bit, so greedy speculative decoding outputs exactly what the target alone does
in any dtype.

Speculative decoding is lossless in distribution, and greedy output equals the target alone's when
the target's verify forward (k tokens at once) computes each token's logits as the target's own
one-token steps do. In float32 the two agree within rounding, which is enough in practice; in
bfloat16 they round differently often enough that at near-ties greedy output takes the other token
(README; ``benchmarks/bf16_identity.py``). The difference comes from kernels whose arithmetic
depends on how many rows they process: a matrix product over 8 rows may sum in another order than
over 1, and attention over 8 query tokens runs another SDPA call (with a mask) than over 1.

:func:`use_batch_invariant_verify` removes both on a model that :func:`optimize_for_cpu` prepares
with ``batch_invariant=True``: every linear layer runs the row-block kernel from one row on (each
output one multiply-add chain in a fixed order, whatever the number of rows), and attention switches
to :data:`ROW_INVARIANT_ATTENTION`, which attends each query token of a cached multi-token step
through the very call a one-token step makes, on the keys that step would see. Norms, rotary
embeddings and activations act on each token alone. A probe then checks the claim on the model
itself: a prefill, then four tokens verified at once against four one-token steps, logits equal bit
for bit, else the switch is undone and ``ValueError`` says so.

Cost: k attention calls per layer instead of one for a k-token verify, and the row-block kernel
even where another kernel would be faster: on an AVX2-only CPU the extra cost of a verify grows with
its tokens, while one-token steps cost the same (``benchmarks/verify_cost.py --compare-invariant``;
measured: docs/performance.md). The prompt's prefill runs as before (it is the same forward with and
without a draft).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.utils import logging

from .attention import CPU_GQA_ATTENTION, cpu_gqa_sdpa_forward, few_query_attention

logger = logging.get_logger(__name__)

ROW_INVARIANT_ATTENTION = "sdpa_cpu_row_invariant"
"""The ``attn_implementation`` name of the attention that handles each query token of a step alone."""
_PROBE_TOKENS = (8, 4)  # prefill, then this many tokens verified at once against as many one-token steps


def row_invariant_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The CPU grouped-query SDPA attention, except that a cached step of several query tokens on CPU
    attends each token through the call a one-token step makes, on the keys that step would see."""
    tokens, keys = query.shape[2], key.shape[2]
    plain_mask = attention_mask is None or attention_mask.dtype == torch.bool
    if tokens == 1 or keys <= tokens or query.device.type != "cpu" or not plain_mask:
        # One token, a prefill (no cache: the same forward with or without a draft), or a mask kind
        # the per-token path does not know: unchanged.
        return cpu_gqa_sdpa_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    # The few-query kernel attends each token alone over the keys it may see: one call does what the
    # loop below does, with the same bits as the one-token steps (which go through it too).
    output = few_query_attention(query, key, value, attention_mask, scaling, dropout, **kwargs)
    if output is not None:
        return output, None
    # A one-token step gets no mask when nothing is padded (transformers skips an all-visible mask).
    padded = attention_mask is not None and not bool(attention_mask[:, :, -1, :].all())
    outputs = []
    for i in range(tokens):
        seen = keys - tokens + i + 1
        mask = attention_mask[:, :, i:i + 1, :seen] if padded else None
        output, _ = cpu_gqa_sdpa_forward(module, query[:, :, i:i + 1], key[:, :, :seen], value[:, :, :seen], mask,
                                         dropout, scaling, False, **kwargs)
        outputs.append(output)
    return torch.cat(outputs, dim=1), None


def _register() -> None:
    if ROW_INVARIANT_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ROW_INVARIANT_ATTENTION, row_invariant_sdpa_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ROW_INVARIANT_ATTENTION, sdpa_mask)


def use_batch_invariant_verify(model: nn.Module) -> None:
    """Switches ``model`` (on CPU, attention ``sdpa`` or :data:`~dspark_cpu.attention.CPU_GQA_ATTENTION`,
    every linear layer already on the row-block kernel from one row) to the per-token attention and
    probes that a 4-token verify gives the logits of 4 one-token steps bit for bit. Raises
    ``ValueError`` naming the problem (and leaves the attention as it was) when it cannot."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    previous = current
    if current != ROW_INVARIANT_ATTENTION:
        if current not in ("sdpa", CPU_GQA_ATTENTION) or not hasattr(model, "set_attn_implementation"):
            raise ValueError(
                f"batch_invariant=True needs a transformers model on 'sdpa' attention; this one runs {current!r}. "
                "Load it with attn_implementation='sdpa'."
            )
        _register()
        model.set_attn_implementation(ROW_INVARIANT_ATTENTION)
    difference = _probe_difference(model)
    if difference is not None:
        model.set_attn_implementation("sdpa" if previous == ROW_INVARIANT_ATTENTION else previous)
        raise ValueError(
            f"batch_invariant=True: a {_PROBE_TOKENS[1]}-token verify of this model does not give the logits of "
            f"{_PROBE_TOKENS[1]} one-token steps ({difference}); some layer of {type(model).__name__} depends on the "
            "number of tokens in a forward. Prepare it without batch_invariant."
        )
    logger.info("optimize_for_cpu: batch-invariant verification: a verify of k tokens gives each the logits of a "
                "one-token step, bit for bit (probed).")


def uses_batch_invariant_verify(model: nn.Module) -> bool:
    """Whether ``model`` runs the per-token attention of :func:`use_batch_invariant_verify`."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ROW_INVARIANT_ATTENTION


def _probe_difference(model: nn.Module) -> str | None:
    prefill, verify = _PROBE_TOKENS
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prefill + verify), generator=generator).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
            stepped = copy.deepcopy(cache)
            together = model(input_ids=ids[:, prefill:], cache=cache, use_cache=True).logits[0]
            alone = torch.cat([model(input_ids=ids[:, i:i + 1], cache=stepped, use_cache=True).logits[0]
                               for i in range(prefill, prefill + verify)])
    finally:
        model.train(was_training)
    if torch.equal(together, alone):
        return None
    return f"max logit difference {(together.float() - alone.float()).abs().max().item():.3g}"


__all__ = ["ROW_INVARIANT_ATTENTION", "row_invariant_sdpa_forward", "use_batch_invariant_verify",
           "uses_batch_invariant_verify"]
