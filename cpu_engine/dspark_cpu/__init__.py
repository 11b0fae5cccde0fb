"""dspark_cpu: the CPU inference engine of dspark_hf.

:func:`optimize_for_cpu` prepares a transformers model (a target or a DSpark draft) in place for fast decoding
on CPU: every linear layer runs from a copy of its weight packed once, with the kernel measured fastest for its
shape on this machine (oneDNN's or the row-block kernel compiled from ``csrc/``); grouped-query attention
attends few-token steps without copying the cache; a Llama-style decoder runs a lean forward. Outputs equal the
stock model's within rounding (``batch_invariant=True``: bit for bit between a verify and one-token steps).

Public API (``from dspark_cpu import ...``):

* :func:`optimize_for_cpu` (also ``dspark_hf.optimize_for_cpu`` while this package is installed) and
  :func:`is_optimized_for_cpu`; :class:`PackedLinear`, the class prepared linear layers take;
* the parts it applies, for those who want one alone or want to undo one: :func:`use_lean_decoder`,
  :func:`remove_lean_decoder`, :func:`uses_lean_decoder`; :func:`use_cpu_gqa_attention` (undone by
  ``model.set_attn_implementation("sdpa")``) and :data:`CPU_GQA_ATTENTION`, its attention name;
* :func:`fast_path_unavailable_reason`, :func:`row_block_unavailable_reason` (why a part cannot run here),
  :data:`PACKED_KERNELS` and :func:`kernel_code_digest`.

The submodules (``fast_path``, ``packed_kernels``, ``row_block``, ``attention``, ``decoder``, ``kv_cache``,
``invariant``, ``huge_pages``, ``extension``, ``kernel_choices``) hold the rest; benchmarks reach into them.

This package plugs into the DSpark core through :mod:`dspark_hf.engine_hooks` (registered on import: the
packing hook for a reduced draft head, and the fingerprint of a prepared model for step-rate profiles). It
imports only dspark_hf's small shared helpers (``cache_dir``, ``build_tools``, ``kv_buffers``, ``machine``,
``engine_hooks``), never the core's subpackages.
"""

from dspark_hf.engine_hooks import register_engine

from .attention import CPU_GQA_ATTENTION, use_cpu_gqa_attention
from .decoder import remove_lean_decoder, use_lean_decoder, uses_lean_decoder
from .fast_path import (PACKED_KERNELS, PackedLinear, fast_path_unavailable_reason, is_optimized_for_cpu,
                        optimize_for_cpu, packed_like, step_rate_fingerprint)
from .kernel_choices import kernel_code_digest
from .row_block import row_block_unavailable_reason

__version__ = "0.1.0"

register_engine(__name__, fingerprint=step_rate_fingerprint, pack_like=packed_like)

__all__ = [
    "CPU_GQA_ATTENTION",
    "PACKED_KERNELS",
    "PackedLinear",
    "fast_path_unavailable_reason",
    "is_optimized_for_cpu",
    "kernel_code_digest",
    "optimize_for_cpu",
    "packed_like",
    "remove_lean_decoder",
    "row_block_unavailable_reason",
    "step_rate_fingerprint",
    "use_cpu_gqa_attention",
    "use_lean_decoder",
    "uses_lean_decoder",
]
