"""CPU fast path, kernel part: the two packed-linear kernels and the measurement that picks one per weight shape.

:func:`~dspark_cpu.fast_path.optimize_for_cpu` packs each linear layer's weight once for one of
two kernels (the module docstring of :mod:`dspark_cpu.fast_path` describes both: oneDNN's
packed linear through private torch ops, and dspark_hf's row-block kernel). This module holds what
concerns the kernels themselves: packing a weight for either and running it (:func:`pack_for`), the
probes that check oneDNN's ops and dtypes work here (:func:`fast_path_unavailable_reason`), and
:func:`measure_packed_kernel`, which times both against ``F.linear`` on weights streamed from memory and
picks, per weight shape and dtype, the kernel and the fewest input rows from which it is used. Choices are
kept for the process and on disk (:mod:`dspark_cpu.kernel_choices`).
"""

from __future__ import annotations

import functools
import math
import time

import torch
import torch.nn.functional as F
from transformers.utils import logging

from . import huge_pages, row_block, kernel_choices

logger = logging.get_logger(__name__)

# oneDNN chooses its blocked weight layout for an expected number of input rows; verify steps run
# 1 to ~16 rows. A hint of 1 makes 2+ rows cost several times one row; 4 to 16 keep 2 rows at about
# the cost of 1 and 8 rows well below 8 (benchmarks/verify_cost.py; measured: docs/performance.md).
_BATCH_SIZE_HINT = 16
ONEDNN, ROW_BLOCK = "onednn", "row_block"
PACKED_KERNELS = (ONEDNN, ROW_BLOCK)
_PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
# Packed must be clearly faster on the probe: near the crossover the two kernels are within the
# probe's noise, and a layer-level win of a few percent did not survive in whole-model steps.
_PACKED_MARGIN = 0.9
# A decode step streams every weight from memory, so the probe times weights that are not in cache:
# each timing batch cycles through copies totalling this many bytes, past the last-level cache of
# the CPUs measured. Timed on one cache-hot copy, the float32 copies of bf16 weights (twice the
# bytes) looked faster from 2 input rows on an AVX2-only CPU; read from memory they were slower at
# 2 rows, and a bf16 verify of 2 tokens came out slower than stock (measured: docs/performance.md).
_PROBE_BYTES = 64 * 2**20
_MAX_PROBE_COPIES = 100
# (out_features, in_features, threads, dtype, candidate kernels) -> (packed kernel, fewest input rows for which it is faster).
_measured_choices: dict[tuple, tuple[str, int]] = {}
PACKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Probe tolerance per dtype: the packed kernel sums in another order (and, in half precision, may
# keep fp32 partial sums where F.linear rounds earlier).
_PROBE_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the packed kernel computes in for weights of ``dtype``: the dtype itself where this
    CPU's oneDNN has kernels for it, float32 for half-precision weights where it has none."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32
    if dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return torch.float32
    return dtype


def _pack(weight: torch.Tensor) -> torch.Tensor:
    weight = weight.detach()
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(kernel_dtype(weight.dtype)), _BATCH_SIZE_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _run_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with the packed ``W``, in ``x``'s dtype (widened and rounded back around a float32 kernel)."""
    if packed.dtype == x.dtype:
        return _packed_linear(x, packed, bias)
    bias = None if bias is None else bias.to(packed.dtype)
    return _packed_linear(x.to(packed.dtype), packed, bias).to(x.dtype)


def pack_for(kernel: str, weight: torch.Tensor, narrow: bool = False) -> tuple:
    """``(packed weight, run)`` for ``kernel``, where ``run(x, packed, bias)`` computes the layer. With ``narrow``,
    a float32 weight for the row-block kernel whose values a 16-bit dtype holds exactly is packed in that dtype
    (:func:`~dspark_cpu.row_block.exact_narrow_dtype`: the same results bit for bit, half the bytes)."""
    if kernel == ROW_BLOCK:
        if row_block_usable(weight.dtype):
            narrow_dtype = row_block.exact_narrow_dtype(weight) if narrow else None
            packed = weight if narrow_dtype is None else weight.detach().to(narrow_dtype)
            return row_block.pack_row_blocks(packed), row_block.runner(weight.shape[0])
        # e.g. a prepared model unpickled in a process that cannot build the kernel: same results within rounding
        logger.warning_once("dspark_hf: a layer packed for the row-block kernel runs on oneDNN's instead: %s.",
                            row_block.row_block_unavailable_reason() or f"no row-block kernel for {weight.dtype}")
    return _pack(weight), _run_packed


def row_block_usable(dtype: torch.dtype) -> bool:
    """Whether the row-block kernel (:mod:`dspark_cpu.row_block`) runs here for ``dtype``
    weights (building it on first call)."""
    return row_block.supports_dtype(dtype) and row_block.row_block_unavailable_reason() is None


def fast_path_unavailable_reason(dtype: torch.dtype = torch.float32) -> str | None:
    """Why the oneDNN packed-linear path cannot be used here for weights of ``dtype``, or None when it can."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    for op in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(torch.ops.mkldnn, op):
            return f"this torch build lacks the private op torch.ops.mkldnn.{op}"
    if dtype not in PACKABLE_DTYPES:
        return f"dtype {dtype} (packed: {', '.join(str(d) for d in PACKABLE_DTYPES)})"
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 16, generator=generator).to(dtype)
        bias = torch.randn(24, generator=generator).to(dtype)
        x = torch.randn(2, 3, 16, generator=generator).to(dtype)
        with torch.no_grad():
            got = _run_packed(x, _pack(weight), bias)
        expected = F.linear(x.float(), weight.float(), bias.float())
    except Exception as error:  # a changed op signature shows up here
        return f"the oneDNN packed-linear ops failed on a {_probe_name(dtype)} probe ({type(error).__name__}: {error})"
    rtol, atol = _PROBE_TOLERANCE[dtype]
    if got.shape != expected.shape or got.dtype != dtype or not torch.allclose(got.float(), expected, rtol=rtol, atol=atol):
        return f"the oneDNN packed-linear ops gave a result different from F.linear on a {_probe_name(dtype)} probe"
    return None


def _probe_name(dtype: torch.dtype) -> str:
    computed_in = kernel_dtype(dtype)
    return str(dtype) if computed_in == dtype else f"{dtype} (computed in {computed_in})"


def _best_seconds(calls: list) -> float:
    best = float("inf")
    for _ in range(5):  # the minimum of five batches shrugs off a busy moment
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, (time.perf_counter() - start) / len(calls))
    return best


def measure_packed_kernel(weight: torch.Tensor, kernels: tuple[str, ...] = PACKED_KERNELS) -> tuple[str, int]:
    """The packed kernel to use for this weight's shape and dtype, and the fewest input rows from
    which it beats ``F.linear``: ``(kernel, min_rows)``, ``kernel`` one of :data:`PACKED_KERNELS`.

    Measured once per shape, dtype and thread count in a process (about 0.2-4 s per shape), on
    random weights of the same shape and dtype, read from memory rather than from cache: a timing
    batch cycles through copies of the weight (up to 64 MB) as a decode step streams the model, the
    row-block kernel's on huge pages where this machine offers them (as :func:`optimize_for_cpu` places them).
    Each candidate (oneDNN's packed kernel; the row-block kernel where it runs here) gets its
    crossover against ``F.linear``; the one whose layer costs least summed over the probed row
    counts (1 to 16, each candidate below its crossover costing what ``F.linear`` costs) is chosen.
    Above the largest probed size (16 rows) the packed kernel is used. ``kernels`` limits the candidates.
    """
    candidates = [k for k in PACKED_KERNELS if k in kernels and (k != ROW_BLOCK or row_block_usable(weight.dtype))]
    if not candidates:
        raise ValueError(f"none of the packed kernels {kernels} runs here for {weight.dtype} weights.")
    key = (weight.shape[0], weight.shape[1], torch.get_num_threads(), weight.dtype, tuple(candidates))
    if key in _measured_choices:
        return _measured_choices[key]
    stored = kernel_choices.load_choice(key)
    if stored is not None:
        _measured_choices[key] = stored
        return stored
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(weight.shape, generator=generator).to(weight.dtype)
    copies = max(1, min(_MAX_PROBE_COPIES, math.ceil(_PROBE_BYTES / (probe.numel() * probe.element_size()))))
    weights = [probe] + [probe.clone() for _ in range(copies - 1)]
    repeat = math.ceil(4 / copies)  # at least four calls per batch, so that a batch outlasts timer noise
    inputs = {rows: torch.randn(1, rows, probe.shape[1], generator=generator).to(weight.dtype) for rows in _PROBE_ROWS}
    stock_seconds: dict[int, float] = {}

    def time_stock(rows: int) -> float:
        x = inputs[rows]
        F.linear(x, probe)  # warm
        stock_seconds[rows] = _best_seconds([functools.partial(F.linear, x, w) for w in weights] * repeat)
        return stock_seconds[rows]

    choices = []
    with torch.no_grad():
        for kernel in candidates:
            packed = [pack_for(kernel, w) for w in weights]
            if kernel == ROW_BLOCK:
                packed = _on_huge_pages_if_offered(packed)  # where optimize_for_cpu puts them by default
            packed_seconds: dict[int, float] = {}

            def packed_wins_at(rows: int) -> bool:
                x = inputs[rows]
                packed[0][1](x, packed[0][0], None)  # warm
                packed_seconds[rows] = _best_seconds([functools.partial(run, x, p, None) for p, run in packed] * repeat)
                return packed_seconds[rows] <= _PACKED_MARGIN * time_stock(rows)  # timed together: same moment

            # The crossover is the smallest size from which the kernel wins at every larger probed size,
            # so sizes are measured from the largest down, to the first that loses. A size that lost is
            # measured once more: one busy moment at a middle size would otherwise push the crossover
            # past it (repeated single-pass probes of one bf16 layer gave crossovers from 1 to 8 rows while
            # its packed kernel was faster at every size).
            min_rows = _PROBE_ROWS[-1] + 1
            for rows in reversed(_PROBE_ROWS):
                if not (packed_wins_at(rows) or packed_wins_at(rows)):
                    break
                min_rows = rows
            del packed
            for rows in _PROBE_ROWS:
                if rows not in stock_seconds:
                    time_stock(rows)
            cost = sum(packed_seconds[r] if r >= min_rows else stock_seconds[r] for r in _PROBE_ROWS)
            choices.append((cost, kernel, min_rows))
    _, kernel, min_rows = min(choices, key=lambda choice: choice[0])  # a tie keeps the earlier (oneDNN)
    _measured_choices[key] = (kernel, min_rows)
    kernel_choices.store_choice(key, (kernel, min_rows))
    return kernel, min_rows


def _on_huge_pages_if_offered(packed: list[tuple]) -> list[tuple]:
    """The probe's ``(copy, run)`` pairs with the copies moved onto huge pages where this machine offers them."""
    if huge_pages.huge_pages_unavailable_reason() is not None or any(p.layout != torch.strided for p, _ in packed):
        return packed
    moved = {}
    try:
        huge_pages.copy_to_huge_pages([p for p, _ in packed], lambda old, new: moved.__setitem__(id(old), new))
    except (OSError, RuntimeError):  # madvise refused, or no memory for the buffer: time them where they are
        return packed
    return [(moved[id(p)], run) for p, run in packed]


__all__ = ["ONEDNN", "PACKABLE_DTYPES", "PACKED_KERNELS", "ROW_BLOCK", "fast_path_unavailable_reason", "kernel_dtype",
           "measure_packed_kernel", "pack_for", "row_block_usable"]
