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


def capture_environment() -> dict:
    """Date, machine, CPU, threads, GPU and library versions of this process, as a JSON-ready dict.

    Keys: ``date`` (local, ``YYYY-MM-DD HH:MM``), ``machine``, ``processor``, ``cpu_model``,
    ``cpu_count``, ``torch_threads``, ``python``, ``torch``, ``torch_cuda`` (the CUDA version torch
    was built with, or ``None``), ``transformers`` and ``gpu`` (the first GPU's name, or ``None``).
    """
    import transformers

    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": _cpu_model(),
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
    return (f"Measured {env['date']} on {where} ({env['cpu_count']} cores, {env['torch_threads']} torch threads), "
            f"torch {env['torch']}, transformers {env['transformers']}.")


__all__ = ["capture_environment", "describe_environment"]
