"""CUDA-graph replay of a fixed-shape GPU call, for the serial-sampling op at small batch sizes.

The op (:mod:`dspark_hf.decoding.cuda_ops`) launches ``1 + 2 * gamma`` kernels per call. At one row, what
``generate()`` uses, each kernel is short, so launch latency can be a large part of the call. A
CUDA graph replays the whole sequence with one launch; the inputs are copied into the graph's
static buffers first and the outputs cloned out after (a few memory copies instead of ``2 * gamma``
kernel launches). The kernels are the same ones, so the results are bit-identical to the eager
call. Whether this is faster on a given GPU is measured by ``tests/gpu/run_gpu_checks.sh`` (speed
stage: eager vs graphed at one row); until it has been, it is off by default
(``DSPARK_HF_CUDA_GRAPH=1`` or ``serial_sample_cuda(..., graph=True)`` turns it on).

One graph is captured per key (the caller's: shapes, dtypes, sampling mode, temperature and the
addresses of the weights the op reads, which the graph has baked in), and at most
:data:`MAX_GRAPHS` are kept (least recently used dropped). Capturing needs a warm-up call and a
capture call, so the first call of each key costs about three eager calls.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

MAX_GRAPHS = 8
ENV_SWITCH = "DSPARK_HF_CUDA_GRAPH"


def graphs_enabled(choice: bool | None = None) -> bool:
    """``choice`` when given, else the ``DSPARK_HF_CUDA_GRAPH`` environment switch (default off)."""
    if choice is not None:
        return bool(choice)
    return os.environ.get(ENV_SWITCH, "0").strip().lower() in ("1", "true", "yes", "on")


class StaticGraph:
    """``fn(*inputs)`` captured once with static input buffers; :meth:`run` copies new inputs in,
    replays and returns clones of the outputs (so later replays never overwrite a caller's result).

    Args:
        fn: a function of tensors (or None) returning a tuple of tensors; it must run on the
            current CUDA stream without host synchronisation (capturable).
        example_inputs: inputs with the shapes, dtypes and devices every later call will have.
    """

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], example_inputs: Sequence[torch.Tensor | None]):
        self.static_inputs = [t.clone() if t is not None else None for t in example_inputs]
        self.graph, self.static_outputs = self._capture(fn, self.static_inputs)

    @staticmethod
    def _capture(fn, inputs) -> tuple[torch.cuda.CUDAGraph, tuple]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS workspaces, allocator)
            fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = tuple(fn(*inputs))
        return graph, outputs

    def run(self, inputs: Sequence[torch.Tensor | None], fill: Callable[[list], None] | None = None) -> tuple:
        """Copies ``inputs`` (None entries are skipped) into the static buffers, lets ``fill``
        write any buffer in place (e.g. draw random numbers into it), replays, returns clones."""
        for static, value in zip(self.static_inputs, inputs):
            if static is not None and value is not None:
                static.copy_(value)
        if fill is not None:
            fill(self.static_inputs)
        self.graph.replay()
        return tuple(t.clone() for t in self.static_outputs)


class GraphCache:
    """Captured graphs by key, least recently used dropped beyond ``max_graphs``."""

    def __init__(self, max_graphs: int = MAX_GRAPHS):
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Hashable, StaticGraph] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, fn: Callable[..., Sequence[torch.Tensor]],
            example_inputs: Sequence[torch.Tensor | None]) -> StaticGraph:
        with self._lock:
            graph = self._graphs.get(key)
            if graph is not None:
                self._graphs.move_to_end(key)
                return graph
            graph = StaticGraph(fn, example_inputs)
            self._graphs[key] = graph
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
            return graph

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)


def can_capture(device: torch.device) -> bool:
    """False where a graph cannot be captured now: not CUDA, or the current stream is already being
    captured (an outer graph, e.g. torch.compile's "reduce-overhead" mode, records the eager call)."""
    return device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


__all__ = ["ENV_SWITCH", "GraphCache", "MAX_GRAPHS", "StaticGraph", "can_capture", "graphs_enabled"]
