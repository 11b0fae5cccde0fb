"""CPU fast path: linear layers that run from weights packed once for oneDNN.

Decoding is memory-bound: a forward of 1 to 16 new tokens reads the same weights, so it should
cost about the same. With torch's default CPU path it does not. ``F.linear`` goes to MKL's sgemm,
which re-packs the weight matrix on every call for small batches (and, on AMD processors, runs its
one-row GEMV at half the speed oneDNN reaches). A verify forward of 2+ tokens then costs 1.5-1.9x a
one-token step, which makes almost every drafted token too expensive to verify.

:func:`optimize_for_cpu` reorders each fp32 ``nn.Linear`` weight once into oneDNN's blocked layout
and runs the layer with oneDNN's linear kernel, the same pair of ops inductor's CPU freezing pass
emits (``torch.ops.mkldnn._reorder_linear_weight`` and ``torch.ops.mkldnn._linear_pointwise``).
These are private torch ops, so they are feature-checked (present, and numerically equal to
``F.linear`` on a small probe) before anything is changed; without them the model is left as it
is and the reason is logged.

What stays the same: parameters (the packed copy is a plain attribute, not a parameter or buffer,
so ``state_dict``/``save_pretrained`` write the ordinary weights), tied weights (the embedding
keeps using the original tensor), autograd (a forward that needs gradients uses ``F.linear``),
accelerate hooks (their saved forward is redirected). If a weight is replaced or modified in place
after packing (``load_state_dict``, an optimiser step, ``.to()``), the layer notices through the
tensor's identity and version counter and packs it again.

Cost: one extra copy of every packed weight (for SmolLM2-135M about 540 MB next to the model's
540 MB) and the packing time, both logged.
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

# oneDNN chooses its blocked weight layout for an expected number of input rows; verify steps run
# 1 to ~16 rows. A hint of 1 makes 2+ rows cost 2-3x one row on the reference CPU; 4 to 16 keep
# 2 rows at the cost of 1 and 8 rows at ~1.5x (benchmarks/verify_cost.py).
_BATCH_SIZE_HINT = 16
_PACKED_ATTRIBUTE = "_dspark_packed_weight"


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_SIZE_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def fast_path_unavailable_reason() -> str | None:
    """Why the oneDNN packed-linear path cannot be used here, or None when it can."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    for op in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(torch.ops.mkldnn, op):
            return f"this torch build lacks the private op torch.ops.mkldnn.{op}"
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 16, generator=generator)
        bias = torch.randn(24, generator=generator)
        x = torch.randn(2, 3, 16, generator=generator)
        with torch.no_grad():
            got = _packed_linear(x, _pack(weight), bias)
        expected = F.linear(x, weight, bias)
    except Exception as error:  # a changed op signature shows up here
        return f"the oneDNN packed-linear ops failed on a probe ({type(error).__name__}: {error})"
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        return "the oneDNN packed-linear ops gave a result different from F.linear on a probe"
    return None


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose no-grad forward uses a oneDNN-packed copy of its weight.

    Instances are made by :func:`optimize_for_cpu` by changing the class of an existing
    ``nn.Linear`` (so parameters, hooks and ties are untouched); do not construct it directly.
    """

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        stamp = (id(weight), weight._version, weight.data_ptr(), weight.dtype, weight.device)
        entry = getattr(self, _PACKED_ATTRIBUTE, None)
        if entry is None or entry[0] != stamp:
            entry = (stamp, _pack(weight))
            object.__setattr__(self, _PACKED_ATTRIBUTE, entry)  # not a parameter or buffer
        return entry[1]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        usable = (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and input.dtype == torch.float32
            and input.device.type == "cpu"
            and not (torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad))
        )
        if not usable:
            return F.linear(input, weight, self.bias)
        return _packed_linear(input, self._packed_weight(), self.bias)


def _skip_reason(module: nn.Linear) -> str | None:
    weight = module.weight
    if weight.device.type == "meta":
        return "weights offloaded (meta device)"
    if weight.device.type != "cpu":
        return f"on {weight.device.type}"
    if weight.dtype != torch.float32:
        return f"dtype {weight.dtype} (only float32 is packed)"
    if type(module) is not nn.Linear:
        return f"subclass {type(module).__name__}"
    return None


def optimize_for_cpu(model: nn.Module) -> nn.Module:
    """Prepares ``model`` in place for fast decoding on CPU and returns it.

    Every float32 ``nn.Linear`` on the CPU runs from a weight packed once for oneDNN (see the module
    docstring for why and what it costs). Outputs equal the stock model's within float32 rounding
    (a different summation order); greedy generation is unchanged in practice, and DSpark's
    losslessness does not depend on it (draft and target are verified, not trusted).

    Use it on CPU for the target and for the draft (whose vocabulary projection is its largest
    matrix; a draft that borrows the target's LM head shares the target's packed one).

    It is idempotent, and a logged no-op for layers it does not handle: other devices, other dtypes,
    weights offloaded by accelerate, ``nn.Linear`` subclasses (e.g. quantised layers). When this
    torch build lacks the oneDNN ops (or they fail a numerical probe), the model is left unchanged
    and the reason is logged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize_for_cpu expects a torch.nn.Module, got {type(model).__name__}.")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    to_pack = [(name, m) for name, m in linears if not isinstance(m, PackedLinear)]
    if not to_pack:
        logger.info("optimize_for_cpu: nothing to do (%d linear layers, all already packed).", len(linears))
        return model
    unavailable = fast_path_unavailable_reason()
    if unavailable is not None:
        logger.warning("optimize_for_cpu: keeping the stock linear layers: %s.", unavailable)
        return model

    start = time.perf_counter()
    packed_bytes, skipped = 0, {}
    with torch.no_grad():
        for name, module in to_pack:
            reason = _skip_reason(module)
            if reason is not None:
                skipped.setdefault(reason, []).append(name)
                continue
            module.__class__ = PackedLinear
            if hasattr(module, "_old_forward"):  # accelerate's hook calls the forward it saved
                module._old_forward = types.MethodType(PackedLinear.forward, module)
            module._packed_weight()
            packed_bytes += module.weight.numel() * module.weight.element_size()
    num_packed = len(to_pack) - sum(len(names) for names in skipped.values())
    logger.info(
        "optimize_for_cpu: packed %d linear layers (%.0f MB of extra memory) in %.2f s.",
        num_packed, packed_bytes / 2**20, time.perf_counter() - start,
    )
    for reason, names in skipped.items():
        logger.info("optimize_for_cpu: left %d linear layer(s) as they are (%s), e.g. %s.", len(names), reason, names[0])
    return model


def is_optimized_for_cpu(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` runs from packed weights."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


__all__ = ["PackedLinear", "fast_path_unavailable_reason", "is_optimized_for_cpu", "optimize_for_cpu"]
