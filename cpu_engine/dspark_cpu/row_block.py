"""The row-block linear kernel: a compiled small-batch ``x @ W.T + b`` for x86 CPUs with AVX2 or AVX-512.

A decode step runs 1 to ~16 input rows through every weight matrix, so it should cost what reading
the weights costs, whatever the number of rows. oneDNN's packed kernel pays a fixed cost per call
(large beside a one-row product of a small model's weights) and MKL's sgemm repacks the weight per call; on CPUs without
bfloat16 instructions neither has a bfloat16 kernel, so a bfloat16 model falls back to a float32 copy
of its weights (twice the bytes to stream). This kernel (``csrc/cpu_row_block_linear.cpp``) stores
the weight once in 16-column blocks in its own dtype (float32, bfloat16 or float16, widened in
registers) and reads each block from memory once, whatever the number of rows, prefetching ahead
where the rows' multiply-adds would otherwise leave the memory idle.

Instruction-set paths: ``avx2`` (AVX2 + FMA + F16C), ``avx512`` (AVX-512 F/BW/VL: one register per
16 columns, up to 8 or 12 rows per group; groups of 3-8 rows of float32 weights on two blocks at once) and
``avx512_bf16`` (adds VDPBF16PS for bfloat16 weights and inputs, twice the multiply-adds per
instruction). The widest the CPU offers is used;
``$DSPARK_HF_ROW_BLOCK_ISA`` (``avx2``, ``avx512``) pins a narrower one for the whole process. Under
AVX-512, bfloat16 weights are stored in pairs of input features (:func:`pack_row_blocks`); a weight
packed that way refuses to run on the AVX2 path rather than give wrong numbers.

Each output is a single float32 multiply-add chain over the input features in order, whatever the
number of rows: a row's result does not depend on the batch it is in. The FMA paths give the same
bits on AVX2 and AVX-512; VDPBF16PS flushes subnormals and may round a pair differently, so the
``avx512_bf16`` path agrees with them within rounding (still independent of the batch). Against
``F.linear`` the sums run in another order, so results agree within rounding (every path the CPU
offers is checked on a probe before use).

:func:`~dspark_cpu.fast_path.optimize_for_cpu` measures this kernel against oneDNN's per
weight shape and uses whichever is faster on the CPU at hand. Build: part of the compiled CPU extension
(:mod:`dspark_cpu.extension`, on first use). Where it cannot be built or the CPU lacks
AVX2/FMA, the oneDNN path is used and the reason is logged once."""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from transformers.utils import logging

from . import extension

logger = logging.get_logger(__name__)

BLOCK = 16  # output columns per block: two AVX2 registers, one AVX-512 register
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = ("avx2", "avx512", "avx512_bf16")  # the kernel's paths, narrowest first
ISA_ENV = "DSPARK_HF_ROW_BLOCK_ISA"
_BFLOAT16_COLUMN_ORDER = torch.arange(BLOCK).view(2, BLOCK // 2).t().reshape(-1)  # 0, 8, 1, 9, ..., 7, 15
_PROBE_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}

_lock = threading.Lock()
_state: dict = {"module": None, "problem": None}


def _load(verbose: bool = False):
    """The compiled module, once it passed the probe (building it on first use); None (reason in ``_state``)
    where that fails."""
    with _lock:
        if _state["module"] is not None or _state["problem"] is not None:
            return _state["module"]
        module = extension.load_extension(verbose)
        problem = extension.extension_problem()
        if problem is None:
            try:
                problem = _probe_problem(module) or _pin_isa(module)
            except Exception as error:  # a module from another build without these functions
                problem = f"probing it failed ({type(error).__name__}: {str(error)[:300]})"
        _state["module"] = None if problem is not None else module
        _state["problem"] = problem
        if problem is not None:
            logger.info("dspark_hf: the CPU row-block linear kernel is not used: %s; oneDNN's kernel runs instead.", problem)
        return _state["module"]


def _probe_problem(module) -> str | None:
    """Checks every instruction-set path the CPU offers against F.linear, and leaves the widest in use."""
    isas = ISAS[:ISAS.index(module.cpu_isa()) + 1]
    generator = torch.Generator().manual_seed(0)
    for isa in isas:
        module.set_isa(isa)
        for dtype in _DTYPES:
            weight = torch.randn(40, 25, generator=generator).to(dtype)  # 40: a partial last block; 25: odd
            bias = torch.randn(40, generator=generator).to(dtype)
            x = torch.randn(2, 13, 25, generator=generator).to(dtype)  # 26 rows: full and partial row groups
            got = module.row_block_linear(x, _pack_for_isa(weight, isa), weight.shape[0], bias)
            expected = F.linear(x.float(), weight.float(), bias.float())
            rtol, atol = _PROBE_TOLERANCE[dtype]
            if got.dtype != dtype or got.shape != expected.shape or not torch.allclose(got.float(), expected, rtol=rtol, atol=atol):
                return f"it gave a result different from F.linear on a {dtype} probe ({isa} path)"
    return None


def _pin_isa(module) -> str | None:
    """Applies ``$DSPARK_HF_ROW_BLOCK_ISA`` (a narrower path than the CPU's widest); a problem names a bad value."""
    pinned = os.environ.get(ISA_ENV, "").strip()
    if not pinned:
        return None
    offered = ISAS[:ISAS.index(module.cpu_isa()) + 1]
    if pinned not in offered:
        return f"{ISA_ENV}={pinned!r} is not one of the paths this CPU offers ({', '.join(offered)})"
    module.set_isa(pinned)
    logger.info("dspark_hf: the CPU row-block linear kernel runs its %s path (%s).", pinned, ISA_ENV)
    return None


def load_kernel(verbose: bool = False) -> None:
    """Builds (first use) and loads the kernel now; raises ``RuntimeError`` with the reason where it cannot.
    ``verbose=True`` builds again, showing the compiler output."""
    if verbose:
        with _lock:
            _state.update(module=None, problem=None)
    if _load(verbose) is None:
        raise RuntimeError(f"The dspark_hf CPU row-block linear kernel is unavailable: {_state['problem']}.")


def row_block_unavailable_reason() -> str | None:
    """Why the kernel cannot run here (building it on first call), or None when it can."""
    _load()
    return _state["problem"]


def supports_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def kernel_isa(build: bool = True) -> str | None:
    """The instruction set the kernel runs with here: ``"avx2"``, ``"avx512"`` or ``"avx512_bf16"``
    (building it on first call; with ``build=False`` None until something else has loaded it); None
    where it cannot run."""
    module = _load() if build else _state["module"]
    return None if module is None else module.isa()


def pack_row_blocks(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in 16-column blocks in its own dtype (the last block zero-padded), in the layout
    the kernel's instruction set reads: [ceil(N / 16), K, 16], except bfloat16 under AVX-512, which is
    stored in pairs of k, [ceil(N / 16), ceil(K / 2), 32] (column j's weights for k and k + 1 side by
    side, as VDPBF16PS reads them). Under AVX2, bfloat16 stores each k's 16 columns in the order 0, 8,
    1, 9, ..., 7, 15, which the kernel widens to float32 in three instructions."""
    return _pack_for_isa(weight, kernel_isa())


def _pack_for_isa(weight: torch.Tensor, isa: str | None) -> torch.Tensor:
    weight = weight.detach()
    out_features, in_features = weight.shape
    blocks = -(-out_features // BLOCK)
    pairs = weight.dtype == torch.bfloat16 and isa in ("avx512", "avx512_bf16")
    padded = weight.new_zeros(blocks * BLOCK, in_features + (in_features % 2 if pairs else 0))
    padded[:out_features, :in_features] = weight
    if pairs:
        return padded.view(blocks, BLOCK, -1, 2).permute(0, 2, 1, 3).reshape(blocks, -1, 2 * BLOCK).contiguous()
    packed = padded.view(blocks, BLOCK, in_features).transpose(1, 2)
    if weight.dtype == torch.bfloat16:
        packed = packed[..., _BFLOAT16_COLUMN_ORDER]
    return packed.contiguous()


# Tried in this order where both hold a weight exactly (often: SmolLM2's bfloat16 values all fit float16), per
# instruction-set path, from whole forwards of SmolLM2 fp32 holding bfloat16 values running each path
# (benchmarks/narrow_packing.py; measured: docs/performance.md). AVX-512: both 16-bit packings are faster than
# float32 packing at 1-8 tokens; from 12 tokens on bfloat16 pairs keep up and float16 falls behind, so bfloat16
# comes first. AVX2: float16 is ahead or level from 4 tokens on, so float16 comes first. A float16-only weight
# under AVX-512 is still packed in float16: decoding steps of 1-8 tokens gain far more than 12+ tokens lose.
_NARROW_ORDER = {"avx2": (torch.float16, torch.bfloat16), "avx512": (torch.bfloat16, torch.float16),
                 "avx512_bf16": (torch.bfloat16, torch.float16)}
_narrow_checks: dict[tuple[str, torch.dtype], bool] = {}


def exact_narrow_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """A 16-bit dtype (bfloat16 or float16, in the order that measured faster on this instruction-set path)
    that holds every value of the float32 ``weight`` exactly and in which the kernel gives the float32
    packing's results bit for bit here (:func:`narrow_packing_matches`), or None. A float32 model loaded
    from a checkpoint stored in half precision has such weights: packed in that dtype they stream from
    memory in half the bytes, and the kernel widens them back to the same float32 values and runs the same
    multiply-add chains."""
    isa = kernel_isa()
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.numel() == 0 or isa is None:
        return None
    for dtype in _NARROW_ORDER[isa]:
        # The pair layout pads an odd K with a zero weight: fine for the results' values, but an output of -0.0
        # would come out +0.0, so bfloat16 narrowing is kept to even widths.
        if dtype == torch.bfloat16 and weight.shape[1] % 2:
            continue
        if narrow_packing_matches(dtype) and torch.equal(weight.to(dtype).float(), weight):
            return dtype
    return None


def narrow_packing_matches(dtype: torch.dtype) -> bool:
    """Whether float32 weights holding only ``dtype`` values, packed in ``dtype``, give here the outputs of
    their float32 packing bit for bit (a probe over 1-17 input rows, once per instruction-set path)."""
    module = _load()
    if module is None:
        return False
    key = (module.isa(), dtype)
    if key not in _narrow_checks:
        generator = torch.Generator().manual_seed(1)
        weight = (torch.randn(48, 40, generator=generator) * 0.1).to(dtype).float()
        weight[0, :5] = torch.tensor([0.0, -0.0, 1e-30, -6e-8, 3.0e4]).to(dtype).float()  # zeros, tiny, large
        bias = torch.randn(48, generator=generator)
        wide, narrow = pack_row_blocks(weight), pack_row_blocks(weight.to(dtype))
        matches = True
        for rows in (1, 2, 3, 5, 8, 9, 13, 17):
            x = torch.randn(rows, 40, generator=generator)
            x[0, :3] = torch.tensor([0.0, -0.0, 1e-40])  # a zero and a subnormal input
            for b in (None, bias):
                got = module.row_block_linear(x, narrow, 48, b)
                expected = module.row_block_linear(x, wide, 48, b)
                matches = matches and torch.equal(got.view(torch.int32), expected.view(torch.int32))
        _narrow_checks[key] = matches
        if not matches:
            logger.info("dspark_hf: float32 weights holding only %s values stay packed in float32: the row-block "
                        "kernel's %s path does not reproduce their float32 results bit for bit from %s packing.",
                        dtype, key[0], dtype)
    return _narrow_checks[key]


def runner(out_features: int):
    """``run(x, packed, bias)`` for a layer of ``out_features`` outputs (the form PackedLinear calls)."""
    linear = _state["module"].row_block_linear

    def run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, packed, out_features, bias)

    return run


def row_block_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype, with ``W`` packed by :func:`pack_row_blocks`."""
    return _state["module"].row_block_linear(x, packed, out_features, bias)


__all__ = ["exact_narrow_dtype", "kernel_isa", "load_kernel", "narrow_packing_matches", "pack_row_blocks",
           "row_block_linear", "row_block_unavailable_reason", "runner", "supports_dtype"]
