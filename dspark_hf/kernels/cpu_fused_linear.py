"""Sibling projections in one row-block call: a decoder layer's query/key/value and gate/up.

The query, key and value projections of an attention layer read the same input, as do the gate and
up projections of a gated MLP. Where all of a group run on the row-block kernel
(:mod:`~dspark_hf.kernels.cpu_row_block`), their packed weights are stored back to back in one
buffer, each layer's packed weight becoming a view of it (no extra memory), and the lean decoder
forward (:mod:`~dspark_hf.kernels.cpu_decoder`) computes the group in one kernel call. The kernel
computes every output column as its own multiply-add chain over the input features, whatever the
other columns, so the group's outputs are the separate calls' outputs bit for bit (the lean
forward's probe checks it again on the model); a call of a few rows then pays one fixed cost
instead of three or two. A group is used only while every member still holds the packed weight it
was given (a weight replaced or modified in place repacks its own layer, and the group steps aside).
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_row_block import BLOCK, row_block_linear


class FusedProjections:
    """The projections of one group (same input), computed by one row-block call.

    Made by :func:`fuse_projections`; calling it returns each projection's output (views of one
    tensor), or None when the input or the layers no longer fit (then the caller runs them one by one).
    """

    def __init__(self, modules: list[nn.Module], packed: torch.Tensor, entries: list[tuple], min_rows: int,
                 bias: torch.Tensor | None, biases: list[tuple[torch.Tensor, int]]) -> None:
        self.modules = modules
        self.packed = packed
        self.entries = entries
        self.min_rows = min_rows
        self.bias = bias
        self.biases = biases  # each member's bias and its version when the fused bias was made
        self.sizes = [module.out_features for module in modules]
        self.out_features = sum(self.sizes)
        self.in_features = modules[0].in_features
        self.dtype = modules[0].weight.dtype

    def __getstate__(self) -> dict:
        # A copy of the model (deepcopy, pickle) repacks each layer on first use, and its groups step aside:
        # the entries hold the kernel's runner, which cannot be pickled, and the buffer would be a second copy.
        state = self.__dict__.copy()
        state.update(packed=None, entries=[])
        return state

    def usable(self, x: torch.Tensor) -> bool:
        """Whether ``x`` and the layers as they are now let one fused call stand in for the separate ones."""
        if self.packed is None or x.dtype is not self.dtype or x.device.type != "cpu":
            return False
        if x.numel() < self.min_rows * self.in_features or x.shape[-1] != self.in_features:
            return False
        if not all(module.has_packed_entry(entry) for module, entry in zip(self.modules, self.entries)):
            return False
        return all(module._parameters["bias"] is bias and bias._version == version
                   for module, (bias, version) in zip(self.modules, self.biases)) if self.biases else True

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        if not self.usable(x):
            return None
        return row_block_linear(x, self.packed, self.out_features, self.bias).split(self.sizes, dim=-1)


def fuse_projections(modules: list[nn.Module]) -> FusedProjections | None:
    """One :class:`FusedProjections` for ``modules`` (linear layers reading the same input), or None
    where they cannot share a call: not all packed for the row-block kernel (``optimize_for_cpu``),
    other dtypes or input sizes, an output count not a multiple of the kernel's 16-column block
    before the last member, or biases on some members only."""
    found = [getattr(module, "row_block_weight", lambda: None)() for module in modules]
    if len(modules) < 2 or any(f is None for f in found):
        return None
    packs = [f[0] for f in found]
    if len({(p.dtype, p.shape[1:]) for p in packs}) != 1 or len({m.in_features for m in modules}) != 1:
        return None
    if any(module.out_features % BLOCK for module in modules[:-1]):
        return None  # a padded block in the middle would shift the later members' columns
    biases = [module.bias for module in modules]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    with torch.no_grad():
        packed = torch.cat(packs, dim=0)
        entries, start = [], 0
        for module, pack in zip(modules, packs):
            entries.append(module.adopt_packed(packed[start:start + pack.shape[0]]))
            start += pack.shape[0]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    bias_versions = [] if bias is None else [(b, b._version) for b in biases]
    return FusedProjections(list(modules), packed, entries, max(f[1] for f in found), bias, bias_versions)


__all__ = ["FusedProjections", "fuse_projections"]
