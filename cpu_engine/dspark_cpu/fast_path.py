"""CPU fast path: linear layers that run from weights packed once, with the kernel that measures fastest.

Decoding is memory-bound: a forward of 1 to 16 new tokens reads the same weights, so it should
cost about the same. With torch's default CPU path it does not. ``F.linear`` goes to MKL's sgemm,
which re-packs the weight matrix on every call for small batches. A verify forward of several
tokens then costs far more than a one-token step, which makes most drafted tokens too expensive to
verify. Where each kernel is fast depends on the processor: on one AMD machine MKL's one-row GEMV
was much slower than oneDNN's; on an Intel Xeon (AVX-512) its GEMV for 1-3 rows beat oneDNN and only
4+ rows fell off the cliff (benchmarks/verify_cost.py; measured: docs/performance.md). So each packed
layer keeps ``F.linear`` for small inputs and picks its packed kernel and the number of input rows from
which it is used from timings taken once per weight shape on this machine (:func:`measure_packed_kernel`).

Two packed kernels compete:

* oneDNN's: :func:`optimize_for_cpu` reorders the weight once into oneDNN's blocked layout and runs
  it with oneDNN's linear kernel, the same pair of ops inductor's CPU freezing pass emits
  (``torch.ops.mkldnn._reorder_linear_weight`` and ``torch.ops.mkldnn._linear_pointwise``). These are
  private torch ops, so they are feature-checked (present, and numerically equal to ``F.linear`` on a
  small probe) before anything is changed; without them the model is left as it is and the reason
  is logged. bfloat16 and float16 weights are packed the same way where this torch build's oneDNN
  supports the dtype on this CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``,
  ``..._fp16_supported()``: avx512-bf16 or AMX kernels), else as float32 copies, with their own probe.
* the row-block kernel (:mod:`dspark_cpu.row_block`): compiled on first use for x86 CPUs
  with AVX2, with AVX-512 and AVX-512 BF16 paths where the CPU has them; weights in 16-column blocks in
  their own dtype, no fixed per-call cost, and a row's result independent of its batch. On the AMD
  CPUs measured (AVX2-only and AVX-512) SmolLM2's one-token step ran faster with it than with oneDNN's
  kernel in fp32 and in bf16, without a float32 copy of bf16 weights (``benchmarks/verify_cost.py
  --compare-onednn``; measured: docs/performance.md).

What stays the same: parameters (the packed copy is a plain attribute, not a parameter or buffer,
so ``state_dict``/``save_pretrained`` write the ordinary weights), tied weights (the embedding
keeps using the original tensor), autograd (a forward that needs gradients uses ``F.linear``),
accelerate hooks (their saved forward is redirected). If a weight is replaced or modified in place
after packing (``load_state_dict``, an optimiser step, ``.to()``), the layer notices through the
tensor's identity and version counter and packs it again.

A float32 model loaded from a checkpoint stored in bfloat16 or float16 (most on the Hub) holds only values of that
dtype: the row-block kernel then streams 16-bit copies of its weights, widened back to the same float32 values in
registers, with the same results bit for bit and half the bytes to stream (``narrow_weights``;
``benchmarks/narrow_packing.py``; measured: docs/performance.md).

Cost: one extra copy of every packed weight (for SmolLM2-135M about 540 MB next to the model's
540 MB, half that in 16-bit copies; twice the weight's own size for oneDNN's float32 copy of half-precision
weights) and the packing and timing at prepare time, both logged. The timing is done once per machine: its outcome
is kept on disk (:mod:`dspark_cpu.kernel_choices`). Where Linux offers transparent huge pages, the
row-block copies then move into one buffer on 2 MB pages, which the step streams faster
(:mod:`dspark_cpu.huge_pages`; ``huge_pages=False`` keeps them where they are).
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

from . import huge_pages, row_block, kernel_choices
from .packed_kernels import (ONEDNN, PACKABLE_DTYPES, PACKED_KERNELS, ROW_BLOCK, fast_path_unavailable_reason,
                                 kernel_dtype, measure_packed_kernel, pack_for, row_block_usable)
from .attention import use_cpu_gqa_attention
from .decoder import use_lean_decoder, uses_lean_decoder
from .invariant import use_batch_invariant_verify

logger = logging.get_logger(__name__)

_PACKED_ATTRIBUTE = "_dspark_packed_weight"
_MIN_ROWS_ATTRIBUTE = "_dspark_packed_min_rows"
_KERNEL_ATTRIBUTE = "_dspark_packed_kernel"
# Whether a float32 weight that a 16-bit dtype holds exactly is packed in that dtype (row_block.exact_narrow_dtype).
_NARROW_ATTRIBUTE = "_dspark_packed_narrow"
# The packed copies may take at most this share of the memory available when packing starts: a model
# that nearly fills memory keeps its stock layers (logged) rather than pushing the machine into swap.
_MEMORY_SHARE = 0.8


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose no-grad forward uses a packed copy of its weight (oneDNN's layout or
    the row-block kernel's, whichever :func:`measure_packed_kernel` chose for its shape).

    Instances are made by :func:`optimize_for_cpu` by changing the class of an existing
    ``nn.Linear`` (so parameters, hooks and ties are untouched); do not construct it directly.
    """

    def __getstate__(self) -> dict:
        # The packed copy may be an opaque oneDNN tensor that cannot be copied or pickled; a copy of the
        # layer (copy.deepcopy, torch.save of the model) packs its own weight on first use.
        state = self.__dict__.copy()
        state.pop(_PACKED_ATTRIBUTE, None)
        return state

    def _packed_entry(self) -> tuple:
        weight = self.weight
        entry = self.__dict__.get(_PACKED_ATTRIBUTE)
        if entry is None or not _entry_matches(entry, weight):
            # Holds the weight itself, so identity is checked by `is` (an id can be reused once a tensor
            # is freed); a replaced weight is released when the layer next repacks.
            packed, run = pack_for(self.__dict__.get(_KERNEL_ATTRIBUTE, ONEDNN), weight,
                                   self.__dict__.get(_NARROW_ATTRIBUTE, False))
            entry = (weight, weight._version, weight.data_ptr(), weight.dtype, packed, run)
            object.__setattr__(self, _PACKED_ATTRIBUTE, entry)  # not a parameter or buffer
        return entry

    def _packed_weight(self) -> torch.Tensor:
        return self._packed_entry()[4]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Every decode step calls this ~200 times for a small model, so the common case reads the
        # module's dictionaries directly and trusts a packed copy made from this very weight tensor.
        state = self.__dict__
        parameters = state["_parameters"]
        weight, bias = parameters["weight"], parameters["bias"]
        if input.numel() < state.get(_MIN_ROWS_ATTRIBUTE, 1) * input.shape[-1]:
            return F.linear(input, weight, bias)
        entry = state.get(_PACKED_ATTRIBUTE)
        if entry is not None and input.dtype is entry[3] and input.is_cpu and _entry_matches(entry, weight) \
                and not (torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad)):
            return entry[5](input, entry[4], bias)
        usable = (
            weight.device.type == "cpu"
            and input.dtype == weight.dtype
            and weight.dtype in PACKABLE_DTYPES
            and input.device.type == "cpu"
            and not (torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad))
        )
        if not usable:
            return F.linear(input, weight, bias)
        entry = self._packed_entry()
        return entry[5](input, entry[4], bias)


def _entry_matches(entry: tuple, weight: torch.Tensor) -> bool:
    """Whether a packed entry was made from ``weight`` as it is now: the same tensor, not modified in
    place since (version counter), not given new storage (``.data =``, as ``.to()`` does)."""
    return entry[0] is weight and entry[1] == weight._version and entry[2] == weight.data_ptr()


def pack_linear(module: nn.Linear, packed_min_rows: int | None = None, kernel: str | None = None,
                narrow: bool = False) -> int:
    """Turns one plain CPU ``nn.Linear`` (of a packable dtype) into a :class:`PackedLinear` in place (parameters,
    hooks and ties untouched) and packs its weight; returns the crossover in input rows it uses.

    ``kernel`` and ``packed_min_rows`` default to what :func:`measure_packed_kernel` measures for the
    layer's shape; a ``packed_min_rows`` given without a ``kernel`` takes the row-block kernel where it
    runs here, else oneDNN's. For callers that have already checked :func:`fast_path_unavailable_reason`
    for its dtype and the layer (plain ``nn.Linear``, on CPU); :func:`optimize_for_cpu` is the public entry point.
    """
    if packed_min_rows is None:
        kernel, packed_min_rows = measure_packed_kernel(module.weight, (kernel,) if kernel else PACKED_KERNELS)
    elif kernel is None:
        kernel = ROW_BLOCK if row_block_usable(module.weight.dtype) else ONEDNN
    module.__class__ = PackedLinear
    if hasattr(module, "_old_forward"):  # accelerate's hook calls the forward it saved
        module._old_forward = types.MethodType(PackedLinear.forward, module)
    object.__setattr__(module, _MIN_ROWS_ATTRIBUTE, packed_min_rows)
    object.__setattr__(module, _KERNEL_ATTRIBUTE, kernel)
    object.__setattr__(module, _NARROW_ATTRIBUTE, narrow)
    with torch.no_grad():
        module._packed_entry()
    return packed_min_rows


def packed_like(source: nn.Module, module: nn.Linear) -> nn.Linear:
    """``module`` packed the way ``source`` is: when ``source`` is a :class:`PackedLinear` (the model
    went through :func:`optimize_for_cpu`) and ``module`` is a plain CPU ``nn.Linear`` of a dtype packed here, it is
    packed in place with ``source``'s kernel and crossover (no timing probe: this can run inside a generation, and
    it keeps a ``packed_min_rows`` the user chose), on huge pages where ``source``'s copy is; otherwise it is
    returned as it is."""
    # The source's dtype passed its probe when it was packed: no second probe inside a generation.
    if isinstance(source, PackedLinear) and _skip_reason(module) is None and module.weight.dtype == source.weight.dtype:
        pack_linear(module, source.__dict__.get(_MIN_ROWS_ATTRIBUTE, 1), source.__dict__.get(_KERNEL_ATTRIBUTE, ONEDNN),
                    source.__dict__.get(_NARROW_ATTRIBUTE, False))
        if huge_pages.on_huge_pages(source._packed_weight()):
            _place_on_huge_pages(module)
    return module


def _skip_reason(module: nn.Linear) -> str | None:
    weight = module.weight
    if weight.device.type == "meta":
        return "weights offloaded (meta device)"
    if weight.device.type != "cpu":
        return f"on {weight.device.type}"
    if type(module) is not nn.Linear:
        return f"subclass {type(module).__name__}"
    return None


def optimize_for_cpu(model: nn.Module, *, packed_min_rows: int | None = None,
                     packed_kernel: str | None = None, batch_invariant: bool = False,
                     huge_pages: bool = True, narrow_weights: bool = True) -> nn.Module:
    """Prepares ``model`` in place for fast decoding on CPU and returns it.

    Every ``nn.Linear`` on the CPU runs from a copy of its weight packed once, with the kernel that
    measures fastest for its shape on this CPU (see the module docstring for why and what it costs):
    oneDNN's packed kernel (float32; bfloat16 and float16 with oneDNN's kernels for them where this
    CPU has them, else through float32 copies, :func:`kernel_dtype`) or the row-block kernel
    (:mod:`dspark_cpu.row_block`: x86 with AVX2 or AVX-512, weights kept in their own dtype,
    built on first use); the number of input rows from which the packed kernel is used is measured too, so a
    kernel that does not pay here is not used. A model on CPU whose attention has grouped key/value
    heads and runs on transformers' ``sdpa`` switches to an attention function that does not copy
    the KV cache on multi-token steps and attends steps of up to 16 tokens with a compiled kernel,
    each token as its one-token step would (:mod:`dspark_cpu.attention`;
    ``model.set_attn_implementation("sdpa")`` undoes it). A Llama-style decoder on CPU (Llama,
    Mistral, Qwen2, Qwen3; full attention) then runs a lean forward: the same layers and arithmetic,
    bit for bit (probed), without the per-module call overhead (:mod:`dspark_cpu.decoder`;
    ``remove_lean_decoder`` undoes it). Outputs equal the stock model's within
    rounding (a different summation order; in bfloat16 that can flip a near-tie between two
    tokens); float32 greedy generation is unchanged in practice, and DSpark's losslessness does not
    depend on it (draft and target are verified, not trusted).

    Use it on CPU for the target and for the draft (whose vocabulary projection is its largest
    matrix; a draft that borrows the target's LM head shares the target's packed one, and a draft
    with a reduced draft vocabulary packs its gathered rows when that head is packed).

    It is idempotent, and a logged no-op for layers it does not handle: other devices, other dtypes
    or a dtype whose packed kernel fails its numerical probe, weights offloaded by accelerate,
    ``nn.Linear`` subclasses (e.g. quantised layers). When this torch build lacks the oneDNN ops (or
    they fail a numerical probe), the model is left unchanged and the reason is logged.

    Args:
        model: the model to prepare.
        packed_min_rows: inputs with fewer rows (tokens x batch) than this keep ``F.linear``; the
            rest use the packed weight. ``None`` (default) measures the kernel and its crossover once
            per weight shape on this machine (:func:`measure_packed_kernel`); ``1`` always uses the
            packed weight.
        packed_kernel: ``"onednn"`` or ``"row_block"`` to use that kernel for every layer; ``None``
            (default) measures, or with ``packed_min_rows`` given takes the row-block kernel where it
            runs here. Asking for ``"row_block"`` where it cannot run raises ``ValueError`` with the reason.
        batch_invariant: make a verify forward of k tokens give every token the logits of a one-token
            step, bit for bit, so that greedy speculative decoding equals the target alone in bf16 and
            fp16 too (:mod:`dspark_cpu.invariant`): every linear on the row-block kernel from
            one row, attention per query token in cached multi-token steps, checked on a probe. Costs
            some verify speed; raises ``ValueError`` with the reason where it cannot hold.
        huge_pages: put the row-block kernel's packed weights in one buffer on 2 MB pages where Linux offers
            transparent huge pages (:mod:`dspark_cpu.huge_pages`: the same bytes, read faster); logged
            where it cannot. ``False`` leaves them in ordinary memory.
        narrow_weights: a float32 weight on the row-block kernel whose every value float16 or bfloat16 holds
            exactly (a model loaded in float32 from a checkpoint stored in half precision, as most on the Hub
            are) is packed in that dtype: half the bytes to stream each step, and the same results bit for bit
            (the kernel widens it back to the same float32 values and runs the same multiply-add chains;
            checked on a probe per instruction set, :func:`~dspark_cpu.row_block.exact_narrow_dtype`).
            ``False`` packs float32 weights in float32.
    """
    if packed_min_rows is not None and (isinstance(packed_min_rows, bool) or not isinstance(packed_min_rows, int)
                                        or packed_min_rows < 1):
        raise ValueError(f"packed_min_rows must be an integer >= 1 or None (measure it), got {packed_min_rows!r}.")
    if packed_kernel not in (None, *PACKED_KERNELS):
        raise ValueError(f"packed_kernel must be one of {PACKED_KERNELS} or None (measure it), got {packed_kernel!r}.")
    if packed_kernel == ROW_BLOCK and row_block.row_block_unavailable_reason() is not None:
        raise ValueError(f"packed_kernel='row_block' cannot run here: {row_block.row_block_unavailable_reason()}. "
                         "Use packed_kernel=None (measure) or 'onednn'.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize_for_cpu expects a torch.nn.Module, got {type(model).__name__}.")
    if batch_invariant:
        packed_kernel, packed_min_rows = _invariant_packing(model, packed_kernel, packed_min_rows)
    _set_narrow_packing(model, narrow_weights)
    _pack_linear_layers(model, packed_min_rows, packed_kernel, narrow_weights)
    first_parameter = next(model.parameters(), None)
    if first_parameter is not None and first_parameter.device.type == "cpu":
        if huge_pages:
            _place_on_huge_pages(model)
        use_cpu_gqa_attention(model)
        use_lean_decoder(model)
        if batch_invariant:
            use_batch_invariant_verify(model)
    elif batch_invariant:
        raise ValueError("batch_invariant=True is for a model on the CPU; move it there first (model.to('cpu')).")
    return model


def _invariant_packing(model: nn.Module, packed_kernel: str | None, packed_min_rows: int | None) -> tuple[str, int]:
    """The row-block kernel from one row, for every linear layer (re-packing layers packed otherwise)."""
    if packed_kernel not in (None, ROW_BLOCK) or packed_min_rows not in (None, 1):
        raise ValueError(f"batch_invariant=True runs every linear on the row-block kernel from one row; drop "
                         f"packed_kernel={packed_kernel!r} / packed_min_rows={packed_min_rows!r}.")
    reason = row_block.row_block_unavailable_reason()
    if reason is not None:
        raise ValueError(f"batch_invariant=True needs the row-block linear kernel, which cannot run here: {reason}.")
    for module in model.modules():
        if isinstance(module, PackedLinear) and (module.__dict__.get(_KERNEL_ATTRIBUTE), module.__dict__.get(
                _MIN_ROWS_ATTRIBUTE)) != (ROW_BLOCK, 1):
            object.__setattr__(module, _KERNEL_ATTRIBUTE, ROW_BLOCK)
            object.__setattr__(module, _MIN_ROWS_ATTRIBUTE, 1)
            module.__dict__.pop(_PACKED_ATTRIBUTE, None)  # packed again on first use
    return ROW_BLOCK, 1


def _set_narrow_packing(model: nn.Module, narrow: bool) -> None:
    """Layers packed before with the other ``narrow`` setting take this one; those on the row-block kernel (the
    only ones it changes) pack again on first use."""
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.__dict__.get(_NARROW_ATTRIBUTE, False) != narrow:
            object.__setattr__(module, _NARROW_ATTRIBUTE, narrow)
            if module.__dict__.get(_KERNEL_ATTRIBUTE) == ROW_BLOCK:
                module.__dict__.pop(_PACKED_ATTRIBUTE, None)


def _pack_linear_layers(model: nn.Module, packed_min_rows: int | None, packed_kernel: str | None,
                        narrow: bool) -> None:
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    to_pack = [(name, m) for name, m in linears if not isinstance(m, PackedLinear)]
    if not to_pack:
        logger.info("optimize_for_cpu: nothing to pack (%d linear layers, all already packed).", len(linears))
        return
    unavailable = fast_path_unavailable_reason()
    if unavailable is not None:
        logger.warning("optimize_for_cpu: keeping the stock linear layers: %s.", unavailable)
        return
    dtype_reasons = {dtype: fast_path_unavailable_reason(dtype)
                     for dtype in {m.weight.dtype for _, m in to_pack} - {torch.float32}}

    skipped = {}
    packable = []
    for name, module in to_pack:
        reason = _skip_reason(module) or dtype_reasons.get(module.weight.dtype)
        if reason is not None:
            skipped.setdefault(reason, []).append(name)
        else:
            packable.append((name, module))
    # The largest the copies can be (oneDNN's float32 copies of half-precision weights where it has no kernel for them).
    needed = sum(m.weight.numel() * kernel_dtype(m.weight.dtype).itemsize for _, m in packable)
    available = available_memory_bytes()
    if available is not None and needed > _MEMORY_SHARE * available:
        logger.warning("optimize_for_cpu: keeping the stock linear layers: their packed copies need %.0f MB and "
                       "%.0f MB of memory is available. Free memory (or load a smaller dtype) to use the fast path.",
                       needed / 2**20, available / 2**20)
        return

    start = time.perf_counter()
    choices = {}
    with torch.no_grad():
        for name, module in packable:
            min_rows = pack_linear(module, packed_min_rows, packed_kernel, narrow)
            choices[(*module.weight.shape, module.weight.dtype)] = (module.__dict__[_KERNEL_ATTRIBUTE], min_rows)
    made = sum(_packed_bytes(m) for _, m in packable)
    widened = sorted({d for (_, _, d), (k, _) in choices.items() if k == ONEDNN and kernel_dtype(d) != d}, key=str)
    for dtype in widened:
        logger.info("optimize_for_cpu: this CPU has no oneDNN %s kernels (they need avx512-bf16/avx512-fp16 or AMX): "
                    "%s layers on oneDNN's kernel run inputs from their crossover on through float32 copies of their weights.",
                    str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))
    logger.info(
        "optimize_for_cpu: packed %d linear layers (%.0f MB of extra memory) in %.2f s.",
        len(packable), made / 2**20, time.perf_counter() - start,
    )
    narrowed = {}
    for _, module in packable:
        packed = module._packed_weight()
        if module.weight.dtype == torch.float32 and getattr(packed, "dtype", None) in (torch.bfloat16, torch.float16):
            narrowed[packed.dtype] = narrowed.get(packed.dtype, 0) + 1
    for dtype, count in narrowed.items():
        logger.info("optimize_for_cpu: %d float32 weights hold only %s values (a checkpoint stored in half precision): "
                    "packed in %s, half the bytes to stream, the same results bit for bit.", count,
                    str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))
    if choices:
        logger.info("optimize_for_cpu: packed kernel and the input rows it is used from, per weight shape "
                    "(timed once per machine, cached in %s): %s.", kernel_choices.choices_path(),
                    ", ".join(f"{o}x{i} {str(d).removeprefix('torch.')}: {k} from {r}"
                              for (o, i, d), (k, r) in sorted(choices.items(), key=str)))
    for reason, names in skipped.items():
        logger.info("optimize_for_cpu: left %d linear layer(s) as they are (%s), e.g. %s.", len(names), reason, names[0])


def _row_block_copies(model: nn.Module) -> tuple[list[torch.Tensor], dict[int, list[PackedLinear]]]:
    """The row-block packed copies of ``model``'s layers not yet on huge pages (packing any not packed yet), and
    the layers using each, by the copy's id (a copy may serve several layers)."""
    copies, owners = [], {}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PackedLinear) and module.__dict__.get(_KERNEL_ATTRIBUTE) == ROW_BLOCK:
                copy = module._packed_entry()[4]
                # skipped: oneDNN's copy where the row-block kernel cannot run here, and copies already moved
                if copy.layout == torch.strided and not huge_pages.on_huge_pages(copy):
                    if id(copy) not in owners:
                        copies.append(copy)
                    owners.setdefault(id(copy), []).append(module)
    return copies, owners


def _place_on_huge_pages(model: nn.Module) -> None:
    """Moves the row-block copies of ``model``'s packed layers onto memory advised for huge pages."""
    packed, owners = _row_block_copies(model)
    if not packed:
        return
    reason = huge_pages.huge_pages_unavailable_reason()
    if reason is not None:
        logger.info("optimize_for_cpu: packed weights stay on ordinary pages: %s.", reason)
        return

    def replace(old: torch.Tensor, new: torch.Tensor) -> None:
        for module in owners.pop(id(old)):
            entry = module.__dict__[_PACKED_ATTRIBUTE]
            object.__setattr__(module, _PACKED_ATTRIBUTE, (*entry[:4], new, *entry[5:]))

    count = len(packed)
    try:
        nbytes = huge_pages.copy_to_huge_pages(packed, replace)
    except (OSError, RuntimeError) as error:  # madvise refused, or no memory for the buffer (torch's allocator)
        # Layers moved before the error read their new copies, the rest their old ones: the same bytes either way.
        logger.info("optimize_for_cpu: packed weights stay on ordinary pages: %s.", error)
        return
    logger.info("optimize_for_cpu: moved %d packed weights (%.0f MB) onto memory advised for 2 MB pages.", count,
                nbytes / 2**20)


def _packed_bytes(module: PackedLinear) -> int:
    """Memory of a layer's packed copy (oneDNN's is opaque: its weight's size in the kernel's dtype)."""
    if module.__dict__[_KERNEL_ATTRIBUTE] == ROW_BLOCK:
        packed = module._packed_weight()
        return packed.numel() * packed.element_size()
    return module.weight.numel() * kernel_dtype(module.weight.dtype).itemsize


def available_memory_bytes() -> int | None:
    """Memory the system can hand out now (``MemAvailable`` in ``/proc/meminfo``), or None where that is not known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def is_optimized_for_cpu(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` runs from packed weights."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def step_rate_fingerprint(model: nn.Module) -> dict:
    """What of this engine's preparation moves ``model``'s step times, for the core's step-rate profile key
    (registered as the engine's ``fingerprint`` with :func:`dspark_hf.engine_hooks.register_engine`): whether its
    linears run packed (then a digest of the kernels' code, :func:`~dspark_cpu.kernel_choices.kernel_code_digest`)
    and whether its decoder runs the lean forward; ``{}`` for a model this engine did not touch."""
    packed, lean = is_optimized_for_cpu(model), uses_lean_decoder(model)
    if not (packed or lean):
        return {}
    fingerprint = {"cpu_fast_path": packed, "lean_decoder": lean}
    if packed:  # a kernel change moves the curve
        fingerprint["cpu_kernel_code"] = kernel_choices.kernel_code_digest()
    return fingerprint


__all__ = ["PACKED_KERNELS", "PackedLinear", "fast_path_unavailable_reason", "is_optimized_for_cpu", "kernel_dtype",
           "measure_packed_kernel", "optimize_for_cpu", "pack_linear", "packed_like",
           "row_block_usable", "step_rate_fingerprint"]
