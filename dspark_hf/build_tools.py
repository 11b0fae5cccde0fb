"""What ``torch.utils.cpp_extension`` needs to build compiled kernels, checked up front: shared by the CUDA
serial-sampling op (:mod:`dspark_hf.decoding.cuda_ops`) and the CPU engine's extension (``dspark_cpu.extension``)."""

from __future__ import annotations

import os
import shutil


def cpp_toolchain_problem(what: str) -> str | None:
    """Why ninja or the C++ compiler needed to build ``what`` is missing, or None when both are there."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return f"ninja is not installed (pip install ninja); torch.utils.cpp_extension needs it to build {what}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++ or set CXX)"
    return None
