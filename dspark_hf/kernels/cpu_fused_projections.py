"""Sibling projections of one input (q/k/v, gate/up) run as one row-block call.

A Llama-style decoder layer runs its query, key and value projections on the same normed input, and
its gate and up projections on another: five calls where two would read the same weights. Each call
costs a Python forward, a dispatch and a start of the kernel's threads, and the small key/value matrices
(SmolLM2: 192 x 576) stream from memory well below the rate of the large ones (docs/benchmarks.md).

The row-block kernel (:mod:`dspark_hf.kernels.cpu_row_block`) stores a weight as 16-column blocks,
[blocks, K, 16] (bfloat16 under AVX-512: [blocks, K / 2, 32]), and computes each output as one float32
chain over the input features in order, whatever else is in its call. Stacking the siblings' packed
copies along the block axis therefore gives one matrix whose call returns, column for column, the bits
the separate calls return. :func:`fuse_sibling_projections` builds that stack once; each sibling's own
packed copy then becomes a view of its part (no extra memory), so the sibling still runs alone wherever
the fused call is not used. The lean decoder (:mod:`dspark_hf.kernels.cpu_decoder`) makes the one call
and splits its output; its probe checks the outputs bit for bit, as for its other shortcuts.

Siblings are fused only where the result cannot change: all packed for the row-block kernel from the
same number of input rows, one dtype, one input width, biases on all or none, and every part but the
last a whole number of blocks. A gate/up pair also needs an intermediate size that is a multiple of 64:
the activation then runs the same vector loop on the split (strided) gate as on a gate of its own.
A sibling whose weight or bias is replaced or modified after fusing makes the fused call step aside
(each sibling runs alone and repacks, as before).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.utils import logging

from . import cpu_row_block
from .cpu_packed_kernels import KERNEL_ATTRIBUTE, MIN_ROWS_ATTRIBUTE, PACKED_ATTRIBUTE, ROW_BLOCK, entry_matches

logger = logging.get_logger(__name__)

FUSED_ATTRIBUTE = "_dspark_fused_projections"
# Parent module (as named in a decoder layer) -> its sibling projections of one input, in output order.
SIBLINGS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
# ATen's vectorized loops take 2 x 16 floats or 2 x 32 half-precision values a step; an intermediate size that
# is a multiple of this leaves no scalar tail in any row, fused or not.
_ACTIVATION_MULTIPLE = 64


class FusedProjections:
    """Sibling linear layers of one input that run as one row-block call (see the module docstring).

    Kept on the parent module as a plain attribute (not a parameter: ``state_dict`` and ``save_pretrained``
    see only the siblings' own weights)."""

    def __init__(self, members: list[nn.Linear], packed: torch.Tensor) -> None:
        self.members = members
        self.sizes = [member.out_features for member in members]
        self.packed = packed
        self.entries = [member.__dict__[PACKED_ATTRIBUTE] for member in members]
        self.dtype = members[0].weight.dtype
        self.min_rows = members[0].__dict__[MIN_ROWS_ATTRIBUTE]
        self.biases = [(member.bias, None if member.bias is None else member.bias._version) for member in members]
        self.bias = None if members[0].bias is None else torch.cat([member.bias.detach() for member in members])
        self.run_kernel = cpu_row_block.runner(sum(self.sizes))

    def __getstate__(self) -> dict:
        # A copy of the model (deepcopy, pickle) gets siblings that pack their own weights on first use, so
        # the stacked copy is not copied: the copy's group is stale and steps aside.
        state = self.__dict__.copy()
        state.update(packed=None, entries=[None] * len(self.members), bias=None, run_kernel=None)
        return state

    def current(self) -> bool:
        """Whether every sibling still runs from its part of the stacked copy, with the weight and bias it had."""
        for member, entry, (bias, version) in zip(self.members, self.entries, self.biases):
            state = member.__dict__
            parameters = state["_parameters"]
            if entry is None or state.get(PACKED_ATTRIBUTE) is not entry or not entry_matches(entry, parameters["weight"]):
                return False
            if parameters["bias"] is not bias or (bias is not None and bias._version != version):
                return False
        return True

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The siblings' outputs for ``x`` (views of one tensor), or None where they must run alone: an input
        they would not run on their packed copies (fewer rows than their crossover, another dtype or device),
        or a sibling changed since fusing."""
        if x.numel() < self.min_rows * x.shape[-1] or x.dtype is not self.dtype or not x.is_cpu or not self.current():
            return None
        return self.run_kernel(x, self.packed, self.bias).split(self.sizes, -1)

    def move_to(self, packed: torch.Tensor) -> None:
        """Runs from ``packed`` (the same bytes elsewhere, e.g. on huge pages), the siblings from views of it."""
        self.packed = packed
        for index, member in enumerate(self.members):
            entry = self.entries[index]
            self.entries[index] = (*entry[:4], _part(packed, self.sizes, index), *entry[5:])
            object.__setattr__(member, PACKED_ATTRIBUTE, self.entries[index])


def _part(packed: torch.Tensor, sizes: list[int], index: int) -> torch.Tensor:
    first = sum(sizes[:index]) // cpu_row_block.BLOCK
    return packed[first:first + -(-sizes[index] // cpu_row_block.BLOCK)]


def fusable_reason(parent_name: str, members: list[nn.Module]) -> str | None:
    """Why ``members`` (the siblings of ``parent_name``) cannot be fused, or None when they can."""
    # Packed layers (cpu_fast_path.PackedLinear, which imports this module) are known by their attributes.
    if not all(m.__dict__.get(KERNEL_ATTRIBUTE) == ROW_BLOCK and hasattr(m, "_packed_entry") for m in members):
        return "not all packed for the row-block kernel"
    if not cpu_row_block.supports_dtype(members[0].weight.dtype) or cpu_row_block.row_block_unavailable_reason():
        return "the row-block kernel does not run here"
    if len({(m.weight.dtype, m.in_features, m.__dict__.get(MIN_ROWS_ATTRIBUTE)) for m in members}) != 1:
        return "dtypes, input widths or crossovers differ"
    if len({m.bias is None for m in members}) != 1:
        return "some have a bias and some not"
    if any(m.out_features % cpu_row_block.BLOCK for m in members[:-1]):
        return f"an output width that is not a multiple of {cpu_row_block.BLOCK}"
    if parent_name == "mlp" and members[0].out_features % _ACTIVATION_MULTIPLE:
        return f"an intermediate size that is not a multiple of {_ACTIVATION_MULTIPLE}"
    if any(m._forward_hooks or m._forward_pre_hooks for m in members):
        return "hooks on a projection"
    return None


def fuse_sibling_projections(model: nn.Module) -> int:
    """Stacks the packed copies of each decoder layer's sibling projections (:data:`SIBLINGS`) where
    :func:`fusable_reason` allows; returns how many groups run fused. Idempotent: a group that is still
    current is kept."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return 0
    fused, refused = 0, {}
    with torch.no_grad():
        for layer in layers:
            for parent_name, names in SIBLINGS.items():
                parent = getattr(layer, parent_name, None)
                members = [getattr(parent, name, None) for name in names]
                if parent is None or any(m is None for m in members):
                    continue
                group = parent.__dict__.get(FUSED_ATTRIBUTE)
                if group is not None and group.current():
                    fused += 1
                    continue
                reason = fusable_reason(parent_name, members)
                if reason is not None:
                    refused.setdefault(reason, f"{parent_name} of {type(layer).__name__}")
                    continue
                parts = [m._packed_entry()[4] for m in members]  # packs any not packed yet
                if len({part.shape[1:] for part in parts}) != 1:
                    refused.setdefault("packed layouts differ", parent_name)
                    continue
                group = FusedProjections(members, torch.cat(parts))
                del parts
                group.move_to(group.packed)  # the siblings' own copies become views of the stack and are freed
                object.__setattr__(parent, FUSED_ATTRIBUTE, group)
                fused += 1
    if fused:
        logger.info("optimize_for_cpu: %d groups of sibling projections (q/k/v, gate/up) run as one row-block call "
                    "each (their packed copies stacked, no extra memory).", fused)
    for reason, example in refused.items():
        logger.info("optimize_for_cpu: sibling projections run apart where %s (e.g. %s).", reason, example)
    return fused


def fused_projections(parent: nn.Module) -> FusedProjections | None:
    """The fused group of ``parent`` (an attention or MLP module), or None."""
    return parent.__dict__.get(FUSED_ATTRIBUTE)


__all__ = ["FUSED_ATTRIBUTE", "FusedProjections", "SIBLINGS", "fuse_sibling_projections", "fusable_reason",
           "fused_projections"]
