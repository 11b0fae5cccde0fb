"""What this machine is, as far as kernel speed goes: the CPU's model name and the vector extensions it has,
and Linux's transparent huge page mode.

A small helper shared by the core (the benchmarks' environment record, the step-rate profile key) and the CPU
engine (``dspark_cpu``: its disk cache of kernel choices, which must not reuse a choice measured on another
processor, and its placement of packed weights on huge pages). It imports nothing of either.
"""

from __future__ import annotations

import functools
from pathlib import Path

# The instruction-set extensions that decide which CPU kernels run (fp32 AVX2/AVX-512, bf16/fp16 dot
# products, AMX tiles): two machines with the same core count can differ by these alone.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


@functools.cache  # read on every step-rate profile lookup; the CPU does not change while the process runs
def cpu_model(cpuinfo_path: str = "/proc/cpuinfo") -> str | None:
    """The CPU's marketing name from ``/proc/cpuinfo`` (Linux), else ``None``."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        return None


def cpu_isa_flags(cpuinfo_path: str = "/proc/cpuinfo") -> list[str] | None:
    """The :data:`ISA_FLAGS` this CPU reports in ``/proc/cpuinfo`` (Linux), else ``None``."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else [flag for flag in ISA_FLAGS if flag in flags]


THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
"""Where Linux names its transparent huge page mode."""


def transparent_huge_pages_mode(setting_path: Path = THP_SETTING) -> str | None:
    """Linux's transparent huge page mode (``"always"``, ``"madvise"`` or ``"never"``), or None where it is not known."""
    try:
        setting = Path(setting_path).read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in setting.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else None


__all__ = ["ISA_FLAGS", "THP_SETTING", "cpu_isa_flags", "cpu_model", "transparent_huge_pages_mode"]
