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


def _cpu_model() -> str | None:
    """The CPU's marketing name from ``/proc/cpuinfo`` (Linux), else ``None``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        return None


# The instruction-set extensions that decide which CPU kernels run (fp32 AVX2/AVX-512, bf16/fp16 dot
# products, AMX tiles): two machines with the same core count can differ by these alone.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def _cpu_isa_flags(cpuinfo_path: str = "/proc/cpuinfo") -> list[str] | None:
    """The :data:`ISA_FLAGS` this CPU reports in ``/proc/cpuinfo`` (Linux), else ``None``."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else [flag for flag in ISA_FLAGS if flag in flags]


def _torch_cpu_capability() -> str | None:
    """The vector ISA torch's CPU kernels dispatch to (e.g. ``"AVX512"``), when torch reports it."""
    getter = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return getter() if getter is not None else None


def capture_environment() -> dict:
    """Date, machine, CPU, threads, GPU and library versions of this process, as a JSON-ready dict.

    Keys: ``date`` (local, ``YYYY-MM-DD HH:MM``), ``machine``, ``processor``, ``cpu_model``,
    ``cpu_isa_flags`` (the :data:`ISA_FLAGS` the CPU has), ``torch_cpu_capability``, ``cpu_count``, ``torch_threads``, ``python``, ``torch``, ``torch_cuda`` (the CUDA version torch
    was built with, or ``None``), ``transformers`` and ``gpu`` (the first GPU's name, or ``None``).
    """
    import transformers

    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": _cpu_model(),
        "cpu_isa_flags": _cpu_isa_flags(),
        "torch_cpu_capability": _torch_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def describe_environment(env: dict) -> str:
    """One sentence naming where ``env`` (from :func:`capture_environment`) was measured."""
    where = env.get("cpu_model") or env.get("machine")  # the benchmarks run on the CPU
    if env.get("cpu_isa_flags"):
        where += f" [{' '.join(env['cpu_isa_flags'])}]"
    return (f"Measured {env['date']} on {where} ({env['cpu_count']} cores, {env['torch_threads']} torch threads), "
            f"torch {env['torch']}, transformers {env['transformers']}.")


__all__ = ["capture_environment", "describe_environment"]
