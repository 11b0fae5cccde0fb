"""Where a measurement was taken: one record shared by every benchmark that writes numbers.

``dspark-hf bench``, ``python -m dspark_hf.benchmarks.evaluation`` and ``examples/bench_serial_op.py``
store :func:`capture_environment` next to their results, so numbers from different runs compare
field by field.
"""

from __future__ import annotations

import os
import platform
import time

import torch

from ..machine import ISA_FLAGS, cpu_isa_flags, cpu_model, transparent_huge_pages_mode


def _torch_cpu_capability() -> str | None:
    """The vector ISA torch's CPU kernels dispatch to (e.g. ``"AVX512"``), when torch reports it."""
    getter = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return getter() if getter is not None else None


def capture_environment() -> dict:
    """Date, machine, CPU, threads, GPU and library versions of this process, as a JSON-ready dict.

    Keys: ``date`` (local, ``YYYY-MM-DD HH:MM``), ``machine``, ``processor``, ``cpu_model``,
    ``cpu_isa_flags`` (the :data:`ISA_FLAGS` the CPU has), ``torch_cpu_capability``, ``transparent_huge_pages``
    (Linux's mode, which decides whether packed weights sit on 2 MB pages), ``cpu_count``, ``torch_threads``,
    ``python``, ``torch``, ``torch_cuda`` (the CUDA version torch
    was built with, or ``None``), ``transformers`` and ``gpu`` (the first GPU's name, or ``None``).
    """
    import transformers

    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": cpu_model(),
        "cpu_isa_flags": cpu_isa_flags(),
        "torch_cpu_capability": _torch_cpu_capability(),
        "transparent_huge_pages": transparent_huge_pages_mode(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def multiply_add_rate(size: int = 256, calls: int = 20) -> float:
    """The float32 multiply-add throughput the torch threads get at this moment, in GFLOP/s: the best of
    three batches of ``calls`` products of cache-resident ``size`` x ``size`` matrices.

    On a shared VM it moves with the host's load, by tens of percent within one session
    (``benchmarks/verify_cost.py`` prints it). Verify forwards of several tokens
    are partly bound by it while one-token steps stream weights from memory, so T(8)/T(1) moves with it;
    benchmarks print it beside such ratios."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator) for _ in range(2))
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * calls / best / 1e9


def describe_environment(env: dict) -> str:
    """One sentence naming where ``env`` (from :func:`capture_environment`) was measured."""
    where = env.get("cpu_model") or env.get("machine")  # the benchmarks run on the CPU
    if env.get("cpu_isa_flags"):
        where += f" [{' '.join(env['cpu_isa_flags'])}]"
    return (f"Measured {env['date']} on {where} ({env['cpu_count']} cores, {env['torch_threads']} torch threads), "
            f"torch {env['torch']}, transformers {env['transformers']}.")


__all__ = ["ISA_FLAGS", "capture_environment", "describe_environment", "multiply_add_rate"]
