"""The CUDA serial-sampling op's path exercised on a machine without a GPU.

:func:`pretend_cuda_op_is_built` is what every such test sets up first: CPU tensors count as
CUDA tensors and the extension as built, so ``serial_sample`` takes its op path and reaches the
one entry point the test replaces (the whole op, or the raw kernel launcher), which records its
calls or runs the PyTorch emulation of the kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import dspark_hf.decoding.sampling
from dspark_hf.decoding import cuda_ops


def pretend_cuda_op_is_built(monkeypatch: pytest.MonkeyPatch, entry_point: str, replacement: Callable) -> None:
    """Routes ``serial_sample``'s CUDA-op path on CPU tensors to ``replacement``, set as
    ``cuda_ops.<entry_point>`` (``"serial_sample_cuda"`` or ``"_run_op"``). ``DSPARK_HF_CUDA_OP`` is
    unset so that the op is on by default, as on a GPU machine."""
    if not hasattr(cuda_ops, entry_point):
        raise AttributeError(f"dspark_hf.decoding.cuda_ops has no {entry_point!r} to replace; name one of its functions.")
    monkeypatch.setattr(dspark_hf.decoding.sampling, "_may_use_cuda_op", lambda backend, t: backend != "reference")
    monkeypatch.setattr(cuda_ops, "_on_cuda", lambda t: True)
    monkeypatch.setattr(cuda_ops, "load_extension", lambda verbose=False: None)
    monkeypatch.setattr(cuda_ops, entry_point, replacement)
    monkeypatch.delenv("DSPARK_HF_CUDA_OP", raising=False)
