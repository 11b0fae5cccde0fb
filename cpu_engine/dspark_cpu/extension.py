"""The compiled CPU extension: dspark_hf's x86 kernels (``csrc/cpu_*.cpp``), built once and loaded on first use.

It holds the row-block linear kernel (:mod:`dspark_cpu.row_block`) and the few-query
attention kernel (:mod:`dspark_cpu.attention`). Each of those probes its own functions
against PyTorch before use; this module only builds and loads. Build: ``torch.utils.cpp_extension.load``
(about 40 s the first time; needs a C++ compiler and ninja), cached next to the CUDA op
(:func:`dspark_hf.cache_dir.extension_dir`) and rebuilt when a source changes. Where it cannot be
built or the CPU lacks AVX2/FMA, :func:`load_extension` returns None and the reason is kept, and the
callers log it and run PyTorch's kernels instead.
"""

from __future__ import annotations

import platform
import threading
import time
from pathlib import Path

import torch
from transformers.utils import logging

from dspark_hf.cache_dir import extension_dir
from dspark_hf.build_tools import cpp_toolchain_problem

logger = logging.get_logger(__name__)

EXTENSION_NAME = "dspark_hf_cpu_kernels"
SOURCE_NAMES = ("cpu_bindings.cpp", "cpu_row_block_linear.cpp", "cpu_few_query_attention.cpp", "cpu_rms_norm.cpp",
                "cpu_rotary.cpp", "cpu_kv_append.cpp")
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCE_FILES = ("cpu_kernels.h", "cpu_vec_avx2.h", *SOURCE_NAMES)  # all that the build reads

_lock = threading.Lock()
_state: dict = {"module": None, "problem": None}


def _cpu_problem() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is written for x86-64 and this machine is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"it needs AVX2 and FMA, and torch reports this CPU's capability as {capability}"
    return None


def build_extension(source_dir: Path = SOURCE_DIR, name: str = EXTENSION_NAME, build_dir: Path | None = None,
                    verbose: bool = False):
    """Compiles (or loads the cached build of) the extension from ``source_dir``; raises on failure.
    Another ``source_dir`` and ``name`` build an older version beside it (``benchmarks/verify_cost.py
    --attention-baseline``)."""
    from torch.utils import cpp_extension

    build_dir = build_dir or extension_dir() / "cpu_kernels"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob(f"{name}*.so")):
        logger.warning("dspark_hf: compiling the CPU kernels (first use only, about 40 s) in %s ...", build_dir)
    start = time.perf_counter()
    # -ffp-contract=off: a multiply and an add stay two roundings unless the source asks for an FMA (the
    # rotary kernel must round as PyTorch's separate ops do).
    # -fopenmp: at::parallel_for splits work only when compiled with OpenMP; the library it links
    # (libgomp.so.1) resolves to the one torch has already loaded.
    # Another version's folder builds the sources it has (its bindings name only its own functions).
    names = SOURCE_NAMES if Path(source_dir) == SOURCE_DIR else sorted(p.name for p in Path(source_dir).glob("cpu_*.cpp"))
    module = cpp_extension.load(name=name, sources=[str(Path(source_dir) / s) for s in names],
                                extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"],
                                build_directory=str(build_dir), verbose=verbose)
    logger.info("dspark_hf: CPU kernels ready (%.1f s).", time.perf_counter() - start)
    return module


def load_extension(verbose: bool = False):
    """The compiled module, building it on first use; None where that fails (:func:`extension_problem` says why).
    ``verbose=True`` builds again, showing the compiler output."""
    with _lock:
        if verbose:
            _state.update(module=None, problem=None)
        if _state["module"] is not None or _state["problem"] is not None:
            return _state["module"]
        problem = _cpu_problem() or cpp_toolchain_problem("the CPU kernels")
        if problem is None:
            try:
                _state["module"] = build_extension(verbose=verbose)
            except Exception as error:  # compiler errors, missing headers, load failures
                problem = (f"building it failed ({type(error).__name__}: {str(error)[:300]}); rerun "
                           "dspark_cpu.row_block.load_kernel(verbose=True) to see the compiler output")
        _state["problem"] = problem
        return _state["module"]


def loaded_extension():
    """The module if it is already built and loaded, else None; takes no lock and builds nothing (for
    per-step paths that were set up by :func:`load_extension` at prepare time)."""
    return _state["module"]


def extension_problem() -> str | None:
    """Why the extension cannot be used here (building it on first call), or None when it can."""
    load_extension()
    return _state["problem"]


__all__ = ["build_extension", "extension_problem", "load_extension", "loaded_extension"]
