"""A disk cache of the packed-kernel choices :func:`~dspark_cpu.packed_kernels.measure_packed_kernel` makes.

Timing every weight shape against every kernel takes most of ``optimize_for_cpu``'s time (seconds
for SmolLM2 the first time, a small fraction of that in a later process that reads the choices from
here; README, "CPU fast path"). The choice depends on the processor, the torch build, the thread count and the kernels'
code, not on the weights' values, so it is kept in ``<cache>/kernel_choices/<environment>.json``
(``<cache>``: :func:`dspark_hf.cache_dir.default_cache_dir`) and a later process on the same machine
reads it instead of timing again. The file name is a digest of the CPU model and instruction-set
flags, torch's version and CPU capability, the source of the measuring code and of the row-block
kernel, and the instruction-set path the row-block kernel runs (a pinned narrower path is timed apart):
any of them changing starts a new file. Delete the folder to measure again. A
file that cannot be read or written is logged and ignored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch
from transformers.utils import logging

from dspark_hf.cache_dir import default_cache_dir
from dspark_hf.machine import cpu_isa_flags, cpu_model
from .extension import SOURCE_FILES
from .row_block import kernel_isa

logger = logging.get_logger(__name__)

_KERNEL_FILES = ("fast_path.py", "packed_kernels.py", "attention.py",
                 *(f"csrc/{name}" for name in SOURCE_FILES))
_unwritable: set[Path] = set()


@functools.cache  # the files do not change while the process runs
def kernel_code_digest() -> str:
    """A digest of the code that chooses and runs the packed kernels: a step-rate profile or a kernel
    choice taken with other code is not reused."""
    here = Path(__file__).resolve().parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in _KERNEL_FILES)).hexdigest()[:16]


def _environment() -> dict:
    return {"cpu_model": cpu_model(), "cpu_isa_flags": cpu_isa_flags(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "kernel_code": kernel_code_digest(),
            "row_block_isa": kernel_isa(build=False)}  # loaded wherever the row-block kernel is a candidate


def choices_path() -> Path:
    """The file that holds the choices measured in this environment."""
    digest = hashlib.sha256(json.dumps(_environment(), sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / "kernel_choices" / f"{digest}.json"


def _entry_name(key: tuple) -> str:
    out_features, in_features, threads, dtype, candidates = key
    return f"{out_features}x{in_features}-{str(dtype).removeprefix('torch.')}-threads{threads}-{'+'.join(candidates)}"


def _read(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        choices = record["choices"]
        if not isinstance(choices, dict):
            raise ValueError("'choices' is not a mapping")
        return choices
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("Ignoring the kernel-choice cache %s (%s); the kernels will be timed again.", path, error)
        return {}


def load_choice(key: tuple) -> tuple[str, int] | None:
    """The stored ``(kernel, min_rows)`` for ``key`` (out, in, threads, dtype, candidates), if there is a valid one."""
    value = _read(choices_path()).get(_entry_name(key))
    if (isinstance(value, list) and len(value) == 2 and value[0] in key[4] and isinstance(value[1], int)
            and value[1] >= 1):
        return value[0], value[1]
    return None


def store_choice(key: tuple, choice: tuple[str, int]) -> None:
    """Adds ``choice`` for ``key`` to the file (written whole and atomically; concurrent writers may drop an entry,
    which is then measured again)."""
    path = choices_path()
    choices = _read(path)
    choices[_entry_name(key)] = list(choice)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump({"environment": _environment(), "choices": choices}, f, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as error:
        if path not in _unwritable:  # once per file: a read-only cache would otherwise warn for every shape
            _unwritable.add(path)
            logger.warning("Could not write the kernel-choice cache %s (%s); choices are timed again in each "
                           "process.", path, error)


__all__ = ["choices_path", "kernel_code_digest", "load_choice", "store_choice"]
