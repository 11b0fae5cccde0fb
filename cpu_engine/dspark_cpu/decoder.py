"""A lean decoder forward: the model's own layers, without the framework's per-call cost.

A one-token step of a small model on a CPU spends much of its time outside the kernels. In a
SmolLM2-135M step with packed weights the linear kernels took little more than half; the rest was
spread thin over ~450 ``nn.Module`` calls, decorators, keyword plumbing and small ops (``cProfile``).
Compiling would remove it, but inside ``generate`` the compiled target recompiled on every new cache
stride and keyword set (a trial; docs/performance.md).

:func:`use_lean_decoder` gives a Llama-style decoder (Llama, Mistral, Qwen2, Qwen3 with full
attention) a forward that runs the same computation in one plain loop: each layer's own
projections, cache update and attention function, in the order of transformers' code, but each
leaf module's ``forward`` called directly instead of through ``__call__``, and the causal mask and
rotary tables made once per step, as the stock forward does. Two shortcuts give the same numbers in
fewer ops: torch's ``rms_norm`` for transformers' RMSNorm where it is the same sequence of ops in one
call (float32; each norm is checked on random inputs) and a rolled rotation for ``rotate_half``
(``(-a) * b == a * (-b)`` exactly). Where dspark_hf's CPU extension builds, the norms and the
rotation run as single compiled calls with PyTorch's own roundings and summation order
(``csrc/cpu_rms_norm.cpp``, ``csrc/cpu_rotary.cpp``): each replaces 7-9 small ops whose dispatch cost
far more than their arithmetic (the gain is largest in bf16, smaller in fp32, where torch's fused
``rms_norm`` already served: ``benchmarks/verify_cost.py --compare-lean-ops``; measured: docs/performance.md). The norm's
summation width is the one that reproduces this torch build on random rows, and the kernel is not used
where none does. A probe runs a prefill and two cached steps
both ways and requires equal outputs bit for bit: if the shortcuts differ the
model's own norm and rotary functions are used; if the loop still differs it is not installed
(logged). A third shortcut, checked by the same probe, writes each step's keys and values into spare
room of the cache instead of concatenating them (:mod:`dspark_cpu.kv_cache`).

Any call it was not built for takes the model's own forward: training or gradients, attention
weights requested, keyword arguments it does not know, a cache other than ``DynamicCache``, or hooks
on the modules it bypasses (other than transformers' own output-capturing hooks, whose hidden
states it returns itself). Hooks are looked up on the modules the model had when it was prepared:
after replacing one of its submodules, call :func:`remove_lean_decoder` and prepare it again.
"""

from __future__ import annotations

import inspect
import itertools
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from . import extension
from .kv_cache import append_to_cache

logger = logging.get_logger(__name__)

_DECODER_LAYER_CLASSES = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
# MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)); others run their own forward.
_GATED_MLP_CLASSES = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
# RMSNorms computing weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(x.dtype); torch's rms_norm
# stands in for them where _fused_norm_matches (float32: the same ops; bfloat16 rounds elsewhere).
_RMS_NORM_CLASSES = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
_KNOWN_KEYWORDS = {"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "inputs_embeds",
                   "use_cache", "output_hidden_states", "output_attentions", "return_dict"}
_INSTALLED_ATTRIBUTE = "_dspark_lean_decoder"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lean_decoder_unsupported_reason(model: nn.Module) -> str | None:
    """Why :func:`use_lean_decoder` cannot take ``model``'s decoder, or None when it can.

    ``model`` is the causal LM or its base model."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb", "config") if not hasattr(base, name)]
    if missing:
        return f"{type(base).__name__} has no {', '.join(missing)}"
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return "its layers are not a non-empty nn.ModuleList"
    if getattr(base, "gradient_checkpointing", False) and base.training:
        return "gradient checkpointing is on"
    if hasattr(base, "_hf_hook") or any(hasattr(m, "_hf_hook") for m in base.modules()):
        return "accelerate hooks (device_map or offloading) run its forward"
    config = base.config
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return f"it uses sliding-window attention (sliding_window={config.sliding_window})"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "it has layers other than full attention"
    for layer in layers:
        name = type(layer).__name__
        if name not in _DECODER_LAYER_CLASSES:
            return f"decoder layer {name} (supported: {', '.join(sorted(_DECODER_LAYER_CLASSES))})"
        attention = layer.self_attn
        if getattr(attention, "sliding_window", None) is not None or getattr(layer, "attention_type",
                                                                             "full_attention") != "full_attention":
            return "it has sliding-window attention layers"
        if not all(hasattr(attention, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return f"attention {type(attention).__name__} lacks the q/k/v/o projections"
    return None


class _LeanPlan:
    """What the lean forward needs to know about one model, found once when it is installed."""

    def __init__(self, base: nn.Module) -> None:
        layers = list(base.layers)
        bypassed = [base.embed_tokens, base.norm, base.rotary_emb] + [m for layer in layers for m in layer.modules()]
        # The hook dictionaries themselves: register_forward_(pre_)hook adds to them in place, so checking
        # them costs a few microseconds a step instead of an attribute lookup per module.
        self.pre_hooks = [m._forward_pre_hooks for m in bypassed]
        self.forward_hooks = [m._forward_hooks for m in bypassed]
        attention_module = sys.modules[type(layers[0].self_attn).__module__]
        self.apply_rotary = attention_module.apply_rotary_pos_emb
        # rotate_half(x) * sin equals roll(x, half) * sin with its first half negated, bit for bit
        # ((-a) * b == a * (-b) in IEEE arithmetic), in 3 ops instead of 5; used where the model's own
        # rotary function is the standard one (checked by the probe like everything else).
        self.roll_rotary = getattr(attention_module, "rotate_half", None) is not None
        # The rolled rotation of queries and keys in one compiled call (csrc/cpu_rotary.cpp: the same
        # roundings), where the CPU extension loads.
        self.rotary_kernel = self.roll_rotary and extension.load_extension() is not None
        self.fused_norm = False  # set by use_lean_decoder after its probe
        # > 0: the norms run in one compiled call (csrc/cpu_rms_norm.cpp) that sums in vectors of this many
        # floats, the width this torch build's sum uses (found by rms_norm_kernel_lanes); 0: they do not.
        self.norm_kernel_lanes = 0
        # Each step's keys and values written into spare room of the layer's cache rather than concatenated
        # (kv_cache.py: the same numbers, other strides; checked by the probe like the shortcuts).
        self.append_in_place = True

    def hooks_allow_lean(self) -> bool:
        # transformers installs output-capturing hooks on decoder layers and attentions (for
        # output_hidden_states / output_attentions); the lean forward returns the hidden states itself and
        # is not used when attentions are asked for. Any other hook must run, so the stock forward does.
        if any(self.pre_hooks):
            return False
        return all(getattr(hook, "__name__", "") == "output_capturing_hook"
                   for hooks in self.forward_hooks if hooks for hook in hooks.values())


def _lean_call_allowed(base: nn.Module, kwargs: dict) -> bool:
    if base.training or torch.is_grad_enabled():
        return False
    if not _KNOWN_KEYWORDS.issuperset(kwargs) or kwargs.get("output_attentions") or kwargs.get("return_dict") is False:
        return False
    if (kwargs.get("input_ids") is None) == (kwargs.get("inputs_embeds") is None):
        return False
    if kwargs.get("use_cache") is False or getattr(base.config, "output_attentions", False):
        return False
    if getattr(base.config, "return_dict", True) is False or isinstance(kwargs.get("attention_mask"), dict):
        return False
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and not isinstance(cache, DynamicCache):
        return False
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return False
    return base.__dict__[_INSTALLED_ATTRIBUTE].hooks_allow_lean()


def _selected_hidden_states(base: nn.Module, output_hidden_states) -> set[int] | None | bool:
    """All (None), the selected indices (a set), or False when no hidden states are wanted."""
    if output_hidden_states is None:
        output_hidden_states = getattr(base.config, "output_hidden_states", False)
    if output_hidden_states is True:
        return None
    if not output_hidden_states:
        return False
    selected = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
    count = base.config.num_hidden_layers + 1
    return {i % count for i in selected if -count <= i < count}


def _norm(plan: _LeanPlan, norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if plan.norm_kernel_lanes:
        kernels = extension.loaded_extension()
        if kernels is not None and hidden_states.device.type == "cpu" and hidden_states.dtype == norm.weight.dtype:
            return kernels.rms_norm(hidden_states, norm.weight, norm.variance_epsilon, plan.norm_kernel_lanes)
    if plan.fused_norm:
        # torch's rms_norm runs the same ops as transformers' RMSNorm (upcast, pow, mean, add eps, rsqrt,
        # mul, cast back, times the weight) inside one call; used only where _fused_norm_matches.
        return F.rms_norm(hidden_states, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.forward(hidden_states)


def _rotary_kernel(plan: _LeanPlan, cos: torch.Tensor, signed_sin: torch.Tensor | None):
    """The compiled rotation for this step's tables (checked once per step, not per layer), or None."""
    kernels = extension.loaded_extension() if plan.rotary_kernel and signed_sin is not None else None
    if (kernels is None or cos.device.type != "cpu" or cos.dtype not in _KERNEL_DTYPES or cos.dim() != 3
            or cos.shape[-1] % 16 or signed_sin.dtype != cos.dtype or cos.stride(-1) != 1 or signed_sin.stride(-1) != 1):
        return None
    return kernels.rotary_embedding


def _rotate(plan: _LeanPlan, query, key, cos, sin, signed_sin, rotary_kernel):
    if signed_sin is None:
        return plan.apply_rotary(query, key, cos, sin)
    if (rotary_kernel is not None and query.dtype == key.dtype == cos.dtype and query.shape[-1] == cos.shape[-1]
            and query.stride(-1) == 1 and key.stride(-1) == 1):
        return rotary_kernel(query, key, cos, signed_sin)
    cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)
    half = query.shape[-1] // 2
    return (query * cos + query.roll(half, -1) * signed_sin), (key * cos + key.roll(half, -1) * signed_sin)


def _attention(plan: _LeanPlan, layer: nn.Module, hidden_states: torch.Tensor, rotary, mask, cache, attention_function):
    attention = layer._modules["self_attn"]
    projections = attention._modules
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, attention.head_dim)
    query = projections["q_proj"].forward(hidden_states).view(hidden_shape)
    key = projections["k_proj"].forward(hidden_states).view(hidden_shape)
    if "q_norm" in projections:  # Qwen3: an RMSNorm over each head before the rotation
        query, key = _norm(plan, projections["q_norm"], query), _norm(plan, projections["k_norm"], key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    value = projections["v_proj"].forward(hidden_states).view(hidden_shape).transpose(1, 2)
    query, key = _rotate(plan, query, key, *rotary)
    if cache is not None and plan.append_in_place:
        key, value = append_to_cache(cache, key, value, attention.layer_idx)
    elif cache is not None:
        key, value = cache.update(key, value, attention.layer_idx)
    extra = {"sliding_window": attention.sliding_window} if hasattr(attention, "sliding_window") else {}
    output, _ = attention_function(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling, **extra)
    return projections["o_proj"].forward(output.reshape(*input_shape, -1).contiguous())


def _mlp(layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    mlp = layer._modules["mlp"]
    if type(mlp).__name__ in _GATED_MLP_CLASSES:
        parts = mlp._modules
        return parts["down_proj"].forward(parts["act_fn"].forward(parts["gate_proj"].forward(hidden_states))
                                          * parts["up_proj"].forward(hidden_states))
    return mlp(hidden_states)


def _lean_forward(base: nn.Module, *args, **kwargs) -> BaseModelOutputWithPast:
    """The base model's forward: the lean loop where it applies, else the model's own forward."""
    if args or not _lean_call_allowed(base, kwargs):
        return type(base).forward(base, *args, **kwargs)
    attention_function = ALL_ATTENTION_FUNCTIONS.get_interface(base.config._attn_implementation, None)
    if attention_function is None:  # eager attention, or one transformers does not list
        return type(base).forward(base, *args, **kwargs)
    plan = base.__dict__[_INSTALLED_ATTRIBUTE]
    input_ids, inputs_embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = base.config.use_cache
    selected = _selected_hidden_states(base, kwargs.get("output_hidden_states"))

    hidden_states = base.embed_tokens.forward(input_ids) if inputs_embeds is None else inputs_embeds
    if use_cache and cache is None:
        cache = DynamicCache(config=base.config)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(hidden_states.shape[1], device=hidden_states.device) + past).unsqueeze(0)
    mask = create_causal_mask(config=base.config, inputs_embeds=hidden_states, attention_mask=kwargs.get("attention_mask"),
                              cache=cache, position_ids=position_ids)
    cos, sin = base.rotary_emb.forward(hidden_states, position_ids=position_ids)
    half = sin.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1) if plan.roll_rotary else None
    rotary = (cos, sin, signed_sin, _rotary_kernel(plan, cos, signed_sin))

    collected = [] if selected is not False else None
    if collected is not None:
        collected.append(hidden_states if selected is None or 0 in selected else None)
    # islice, not base.layers[:n]: slicing a ModuleList builds a new one (a visible cost every step).
    for index, layer in enumerate(itertools.islice(base.layers, base.config.num_hidden_layers)):
        parts = layer._modules
        residual = hidden_states
        hidden_states = _norm(plan, parts["input_layernorm"], hidden_states)
        hidden_states = residual + _attention(plan, layer, hidden_states, rotary, mask, cache, attention_function)
        residual = hidden_states
        hidden_states = residual + _mlp(layer, _norm(plan, parts["post_attention_layernorm"], hidden_states))
        if collected is not None:
            collected.append(hidden_states if selected is None or index + 1 in selected else None)
    hidden_states = _norm(plan, base.norm, hidden_states)

    output = BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)
    if collected is not None:
        # As transformers' capture_outputs: the last entry is the normed final state (if it is kept at all).
        tie_last = getattr(base.config, "tie_last_hidden_states", None)
        if tie_last is not False and collected[-1] is not None:
            collected[-1] = hidden_states
        output["hidden_states"] = tuple(collected)
    return output


class _LeanForward:
    """The decoder's forward while the lean path is installed: a callable object rather than a bound
    method, so that a prepared model can still be pickled and deep-copied."""

    def __init__(self, base: nn.Module) -> None:
        self.base = base

    def __call__(self, *args, **kwargs) -> BaseModelOutputWithPast:
        return _lean_forward(self.base, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.base).forward.__get__(self.base))


def use_lean_decoder(model: nn.Module) -> bool:
    """Gives ``model``'s decoder the lean forward (see the module docstring) if it supports it and a
    probe shows the same outputs, bit for bit, as its own forward; returns whether it runs it.
    Idempotent; :func:`remove_lean_decoder` undoes it. ``model`` is the causal LM or its base model."""
    base = getattr(model, "model", model)
    if _INSTALLED_ATTRIBUTE in base.__dict__:
        return True
    reason = lean_decoder_unsupported_reason(model)
    if reason is None:
        plan = _LeanPlan(base)
        plan.fused_norm = _fused_norm_matches(base)
        plan.norm_kernel_lanes = rms_norm_kernel_lanes(base)
        base.__dict__[_INSTALLED_ATTRIBUTE] = plan
        base.forward = _LeanForward(base)
        reason = _probe_difference(base)
        if reason is not None and (plan.fused_norm or plan.roll_rotary or plan.append_in_place):
            # One of the shortcuts differs here: the model's own norm, rotary and cache functions must agree.
            logger.info("optimize_for_cpu: the lean forward's shortcuts (fused or compiled norm and rotation, keys and "
                        "values written in place) differ here (%s); it calls the model's own instead.", reason)
            plan.fused_norm = plan.roll_rotary = plan.rotary_kernel = plan.append_in_place = False
            plan.norm_kernel_lanes = 0
            reason = _probe_difference(base)
        if reason is not None:
            remove_lean_decoder(model)
    if reason is not None:
        logger.info("optimize_for_cpu: the decoder keeps its own forward: %s.", reason)
        return False
    logger.info("optimize_for_cpu: the decoder runs a lean forward (the same layers and arithmetic, without the "
                "per-module call overhead).")
    return True


def remove_lean_decoder(model: nn.Module) -> None:
    """Gives the decoder back its own forward."""
    base = getattr(model, "model", model)
    base.__dict__.pop(_INSTALLED_ATTRIBUTE, None)
    base.__dict__.pop("forward", None)


def uses_lean_decoder(model: nn.Module) -> bool:
    """Whether ``model``'s decoder runs the lean forward."""
    return _INSTALLED_ATTRIBUTE in getattr(model, "model", model).__dict__


def _fused_norm_matches(base: nn.Module) -> bool:
    """Whether torch's ``rms_norm`` gives every norm of ``base`` its own outputs bit for bit. In float32
    it does; in bfloat16 torch 2.13 multiplies by the weight before rounding, transformers after, so a
    weight other than 1 gives another result there."""
    norms = _rms_norms(base)
    if norms is None:
        return False
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for norm in norms:
            weight = norm.weight
            x = (torch.randn(4, weight.shape[-1], generator=generator) * 3).to(weight.device, weight.dtype)
            if not torch.equal(F.rms_norm(x, weight.shape, weight, norm.variance_epsilon), norm.forward(x)):
                return False
    return True


def _rms_norms(base: nn.Module) -> list[nn.Module] | None:
    norms = [m for m in base.modules() if "Norm" in type(m).__name__]
    if not norms or any(type(m).__name__ not in _RMS_NORM_CLASSES for m in norms):
        return None
    return norms


def rms_norm_kernel_lanes(module: nn.Module) -> int:
    """The vector width (8 or 16 floats) with which the compiled norm gives every RMSNorm in ``module`` its
    own outputs bit for bit on random rows (1, 3 and 8 of them), or 0 where neither does, ``module`` has
    norms of other kinds, or there is no kernel here."""
    norms = _rms_norms(module)
    kernels = extension.load_extension() if norms else None
    if kernels is None or any(n.weight.dtype not in _KERNEL_DTYPES or n.weight.device.type != "cpu" for n in norms):
        return 0
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        samples = [[(torch.randn(1, rows, n.weight.shape[-1], generator=generator) * 3).to(n.weight.dtype)
                    for rows in (1, 3, 8)] for n in norms]
        expected = [[n.forward(x) for x in xs] for n, xs in zip(norms, samples)]
        for lanes in (8, 16):
            if all(torch.equal(kernels.rms_norm(x, n.weight, n.variance_epsilon, lanes), y)
                   for n, xs, ys in zip(norms, samples, expected) for x, y in zip(xs, ys)):
                return lanes
    return 0


def _probe_difference(base: nn.Module) -> str | None:
    """Runs a prefill, a one-token and a three-token step both ways; None if every output is equal."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (1, 12), generator=generator, device="cpu")
    ids = ids.to(base.embed_tokens.weight.device)
    results = []
    was_training = base.training
    base.eval()  # in training mode both would be the stock forward (and dropout would differ)
    try:
        for forward in (type(base).forward.__get__(base), base.forward):
            results.append(_probe_outputs(forward, base, ids))
    finally:
        base.train(was_training)
    for stock, lean in zip(*results):
        if stock.shape != lean.shape or not torch.equal(stock, lean):
            difference = (stock.float() - lean.float()).abs().max().item() if stock.shape == lean.shape else "shape"
            return f"a probe gave outputs different from its own forward (max difference {difference})"
    return None


def _probe_outputs(forward, base: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    cache = DynamicCache(config=base.config)
    outputs = []
    with torch.no_grad():
        for start, end in ((0, 8), (8, 9), (9, 12)):
            # No output_hidden_states: asking for them makes transformers hook every layer for good
            # (closures that a pickled model cannot hold); tests check the hidden states.
            out = forward(input_ids=ids[:, start:end], cache=cache, use_cache=True)
            outputs += [out.last_hidden_state, *cache.layers[-1].keys.unbind(-2)[-1:]]
    return outputs


__all__ = ["lean_decoder_unsupported_reason", "remove_lean_decoder", "rms_norm_kernel_lanes", "use_lean_decoder",
           "uses_lean_decoder"]
