"""What the benchmark scripts share when they measure: the mean time of a call, and a result file.

``examples/bench_serial_op.py``, the GPU checks under ``tests/gpu`` and the scripts in
``benchmarks/`` time calls and store what they measured the same way; writing it once here keeps
their numbers comparable (same warm-up, same clock) and lets every one of them import it, since
examples must not import from ``tests/``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch


def mean_call_ms(fn: Callable[[], object], repeats: int, *, warmup: int = 3, device: str = "cuda") -> float:
    """Milliseconds per call of ``fn``, the mean over ``repeats`` calls made after ``warmup`` untimed ones.

    On ``device="cuda"`` the calls are bracketed by CUDA events with a synchronisation before and
    after, so the time is what the GPU spends on the queued work (launch overhead included when the
    host is the bottleneck); on ``device="cpu"`` they are timed with ``time.perf_counter``.
    """
    if repeats < 1:
        raise ValueError(f"mean_call_ms needs repeats >= 1 to average over, got {repeats}.")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"mean_call_ms times on 'cuda' (CUDA events) or 'cpu' (perf_counter), not {device!r}.")
    for _ in range(warmup):
        fn()
    if device == "cpu":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) * 1e3 / repeats
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_event.record()
    for _ in range(repeats):
        fn()
    end_event.record()
    torch.cuda.synchronize()
    return start_event.elapsed_time(end_event) / repeats


def write_json_result(result: dict, path: str | os.PathLike | None) -> None:
    """Writes ``result`` as indented JSON to ``path`` (creating its folder); does nothing when ``path`` is None,
    which is how the scripts' optional ``--out`` is left unset."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
