"""CPU fast path, attention part: grouped-query attention without copying the KV cache.

transformers' ``sdpa`` attention runs grouped-query attention (fewer key/value heads than query
heads) in one of three ways. For one query token it regroups the query; without a mask it lets
PyTorch's SDPA broadcast the key/value heads (``enable_gqa=True``); with a mask and several query
tokens - every verify forward of speculative decoding - it calls ``repeat_kv``, which copies the
whole cached key and value tensors ``n_rep`` times in every layer, every step. That copy made
SmolLM2-135M's verify forwards measurably slower (``benchmarks/verify_cost.py``), for logits that
came out bit-identical.
(transformers keeps the copy because on CUDA a masked ``enable_gqa`` call falls back to a slow
kernel; PyTorch's CPU kernel takes it directly.)

:func:`use_cpu_gqa_attention` switches a model to the attention function registered here under
:data:`CPU_GQA_ATTENTION`, which makes that one case call SDPA with ``enable_gqa=True`` on CPU
tensors and hands every other case to transformers' own ``sdpa_attention_forward`` unchanged. It
is done through transformers' public ``AttentionInterface`` and ``set_attn_implementation``, so
it is per model and undone by ``model.set_attn_implementation("sdpa")``.

One more case is rerouted: a one-token step in bfloat16 or float16. SDPA's grouped-query broadcast
(``enable_gqa``) with a single query token ran several times slower than the same attention with the
query heads regrouped under their key/value head (``(B, H, 1, D)`` viewed as ``(B, H_kv, H / H_kv, D)``,
the same numbers; measured: docs/performance.md); in float32 the broadcast was the faster, so float32
keeps it.

Where the compiled CPU extension runs (:mod:`dspark_cpu.extension`, x86 with AVX2), steps of
up to :data:`FEW_QUERY_MAX_TOKENS` query tokens over a cache - decode steps and verify forwards - go
to its few-query attention kernel instead of SDPA (``csrc/cpu_few_query_attention.cpp``): SDPA's CPU
kernel is built for long sequences and pays a fixed cost per call that dwarfs one token's work. The
kernel attends each query token alone over the keys its mask lets it see, so a verify of k tokens
gives each the attention output of a one-token step bit for bit; against SDPA results agree within
rounding (probed before first use; where the probe fails the reason is logged and SDPA runs). For that
kernel a model with one key/value head per query head (no grouping) is switched too.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.utils import logging

from . import extension

logger = logging.get_logger(__name__)

CPU_GQA_ATTENTION = "sdpa_cpu_gqa"
"""The ``attn_implementation`` name under which the CPU grouped-query attention is registered."""


FEW_QUERY_MAX_TOKENS = 16
"""The most query tokens a step may have to use the few-query kernel (a prefill runs SDPA)."""
_FEW_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_few_query_lock = threading.Lock()
_few_query_state: dict = {"module": None, "problem": None}


def few_query_unavailable_reason() -> str | None:
    """Why the few-query attention kernel cannot run here (building and probing it on first call), or None."""
    with _few_query_lock:
        if _few_query_state["module"] is None and _few_query_state["problem"] is None:
            module = extension.load_extension()
            problem = extension.extension_problem()
            if problem is None:
                try:
                    problem = _few_query_probe_problem(module)
                except Exception as error:  # a build without this function
                    problem = f"probing it failed ({type(error).__name__}: {str(error)[:300]})"
            _few_query_state.update(module=None if problem else module, problem=problem)
            if problem is not None:
                logger.info("dspark_hf: the CPU few-query attention kernel is not used: %s; SDPA runs instead.", problem)
        return _few_query_state["problem"]


def _few_query_probe_problem(module) -> str | None:
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        query = torch.randn(2, 6, 3, 16, generator=generator).to(dtype)
        key, value = (torch.randn(2, 2, 11, 16, generator=generator).to(dtype) for _ in range(2))
        mask = torch.ones(2, 1, 3, 11, dtype=torch.bool).tril(diagonal=8)
        mask[1, :, :, :4] = False  # left padding
        got = module.few_query_attention(query, key, value, mask, 0.25)
        expected = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                                  scale=0.25, enable_gqa=True).transpose(1, 2)
        if got.shape != expected.shape or got.dtype != dtype or not torch.allclose(got.float(), expected, rtol=tolerance,
                                                                                   atol=tolerance):
            return f"it gave a result different from SDPA on a {dtype} probe"
    return None


_SPECIAL_KWARGS = ("position_bias", "softcap", "output_attentions")  # attention the kernels here do not do


def _special(kwargs: dict) -> bool:
    return any(kwargs.get(name) for name in _SPECIAL_KWARGS)


def few_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None, dropout: float = 0.0,
                        **kwargs) -> torch.Tensor | None:
    """Attention of a few cached query tokens through the compiled kernel, as ``(B, L, H, D)``; None where
    the call is not one it takes (then SDPA runs): more than :data:`FEW_QUERY_MAX_TOKENS` tokens, another
    device or dtype, a head dim not a multiple of 8 or not contiguous, several tokens without a mask, a
    mask that is not boolean ``(B or 1, 1, L, T)`` over exactly the keys given, dropout, a softcap,
    position bias or requested attention weights (``kwargs``), or no kernel here."""
    tokens = query.shape[2]
    if (dropout or _special(kwargs) or query.device.type != "cpu" or query.dtype not in _FEW_QUERY_DTYPES
            or tokens > FEW_QUERY_MAX_TOKENS
            or query.shape[-1] % 8 or key.dtype != query.dtype or value.dtype != query.dtype
            or query.shape[1] % key.shape[1] or key.shape != value.shape or key.shape[0] != query.shape[0]
            or any(t.stride(-1) != 1 for t in (query, key, value))
            or (attention_mask is None and tokens > 1)):
        return None
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4
                                       or attention_mask.shape[1] != 1 or attention_mask.shape[2] != tokens
                                       or attention_mask.shape[0] not in (1, query.shape[0])):
        return None
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[2]:
        return None
    module = _few_query_state["module"]  # read without the lock: set once, on every decode step's path
    if module is None:
        if few_query_unavailable_reason() is not None:
            return None
        module = _few_query_state["module"]
    if attention_mask is not None and attention_mask.stride(-1) != 1:
        attention_mask = attention_mask.contiguous()
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return module.few_query_attention(query, key, value, attention_mask, scale)


def cpu_gqa_sdpa_forward(
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
    """transformers' ``sdpa`` attention, except that with grouped KV heads on CPU a masked multi-token
    call lets SDPA broadcast the heads instead of copying them with ``repeat_kv``, and a one-token
    call in half precision regroups the query heads under their key/value head."""
    groups = getattr(module, "num_key_value_groups", 1)
    output = few_query_attention(query, key, value, attention_mask, scaling, dropout, **kwargs)
    if output is not None:
        return output, None
    special = _special(kwargs)
    if groups > 1 and not special and query.device.type == "cpu" and query.shape[2] == 1 \
            and query.dtype in (torch.bfloat16, torch.float16) and key.shape[1] * groups == query.shape[1] \
            and (attention_mask is None or attention_mask.shape[1] == 1):
        return _one_token_regrouped(query, key, value, attention_mask, dropout, scaling), None
    if (groups == 1 or query.shape[2] == 1 or attention_mask is None or special
            or query.device.type != "cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # With a mask, transformers' path passes is_causal=False too: the mask carries causality.
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                            scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def _one_token_regrouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float, scaling: float | None) -> torch.Tensor:
    """Attention of one query token with the query heads of each key/value head as its rows: the
    rows are heads of one token, so no causal mask applies between them (a padding mask over the
    keys, ``(B, 1, 1, L)``, broadcasts over them). Returns ``(B, 1, H, D)`` like transformers' sdpa."""
    batch, heads, _, dim = query.shape
    grouped = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)
    output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                            scale=scaling, is_causal=False)
    return output.reshape(batch, 1, heads, dim)


def cpu_gqa_unavailable_reason() -> str | None:
    """Why masked ``enable_gqa`` SDPA cannot replace ``repeat_kv`` here, or None when it can."""
    try:
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(1, 6, 3, 16, generator=generator)
        key, value = (torch.randn(1, 2, 9, 16, generator=generator) for _ in range(2))
        mask = torch.ones(3, 9, dtype=torch.bool).tril(diagonal=6)[None, None]
        with torch.no_grad():
            got = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
            expected = F.scaled_dot_product_attention(query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask)
    except Exception as error:  # torch < 2.5 has no enable_gqa
        return f"masked SDPA with enable_gqa failed on a probe ({type(error).__name__}: {error})"
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        return "masked SDPA with enable_gqa gave a result different from repeat_kv on a probe"
    return None


def _register() -> None:
    if CPU_GQA_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(CPU_GQA_ATTENTION, cpu_gqa_sdpa_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(CPU_GQA_ATTENTION, sdpa_mask)


def _has_grouped_kv_heads(config) -> bool:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    return isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads < heads


def use_cpu_gqa_attention(model: nn.Module) -> bool:
    """Switches a transformers model on ``sdpa`` attention to :data:`CPU_GQA_ATTENTION` where that
    helps: with grouped KV heads always, with one key/value head per query head (MHA) where the few-query
    kernel runs here (it then takes decode and verify steps; everything else is transformers' ``sdpa``
    unchanged). Returns whether the model uses it afterwards. A logged no-op for other models (other
    attention implementations, attention layers that do not dispatch through transformers'
    ``AttentionInterface``, such as DSpark drafts, which already call SDPA with ``enable_gqa``)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == CPU_GQA_ATTENTION:
        return True
    # Only models whose attention layers dispatch through AttentionInterface can take the switch.
    dispatches = getattr(model, "_supports_attention_backend", False) and hasattr(model, "set_attn_implementation")
    grouped = config is not None and _has_grouped_kv_heads(config)
    if current != "sdpa" or not dispatches or not (grouped or few_query_unavailable_reason() is None):
        logger.info("optimize_for_cpu: attention left as it is (implementation %r, AttentionInterface: %s, grouped "
                    "KV heads: %s, few-query kernel: %s).", current, bool(dispatches), grouped,
                    few_query_unavailable_reason() or "available")
        return False
    unavailable = cpu_gqa_unavailable_reason() if grouped else None
    if unavailable is not None:
        logger.warning("optimize_for_cpu: keeping transformers' sdpa attention: %s.", unavailable)
        return False
    _register()
    try:
        model.set_attn_implementation(CPU_GQA_ATTENTION)
    except (ValueError, ImportError) as error:
        logger.warning("optimize_for_cpu: keeping transformers' sdpa attention: set_attn_implementation refused "
                       "%r (%s).", CPU_GQA_ATTENTION, error)
        return False
    # Build and probe the few-query kernel now, at prepare time, rather than in the first decode step.
    few_query = few_query_unavailable_reason()
    logger.info("optimize_for_cpu: attention runs %r (%s), %s.", CPU_GQA_ATTENTION,
                "grouped-query SDPA without repeat_kv copies" if grouped else "one key/value head per query head",
                "decode and verify steps through the few-query kernel" if few_query is None
                else f"without the few-query kernel ({few_query})")
    return True


__all__ = ["CPU_GQA_ATTENTION", "FEW_QUERY_MAX_TOKENS", "cpu_gqa_sdpa_forward", "few_query_attention",
           "few_query_unavailable_reason", "cpu_gqa_unavailable_reason", "use_cpu_gqa_attention"]
