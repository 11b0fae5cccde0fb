"""Several training processes (``accelerate launch`` or ``torchrun``): who does what, and safe files.

Training is plain data parallelism. Every process holds the whole draft and the target; each step's
global batch is drawn identically everywhere (one seeded generator) and process ``r`` of ``W``
computes the sequences at positions ``r, r + W, ...`` of it. Gradients are then summed over the
processes with one all-reduce (what DDP does; written out here because a training step calls the
draft several times per sequence, outside any wrapper's ``forward``), so every process takes the
same optimiser step and the draft equals a one-process run with the same global batch, up to the
order of floating-point sums.

Files are safe under concurrency by construction: each unit of work (an answer shard, a feature
chunk) has one owner that writes it to a temporary name and renames it into place, and anything
all processes share (the prompt plan, checkpoints, the saved draft) is written by the main process
alone while the others wait at a barrier.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Ranks:
    """This process's place among the training processes (``rank`` of ``world_size``).

    Build it after ``accelerate.PartialState()`` (or an ``Accelerator``) has set up the process group;
    with one process every collective is a no-op.
    """

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size

    @classmethod
    def current(cls) -> "Ranks":
        """The ranks of the initialised process group, or a single process when there is none."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def share(self, count: int) -> list[int]:
        """This process's positions among ``count`` units of work: ``rank, rank + W, ...``."""
        return list(range(self.rank, count, self.world_size))

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """The main process's ``value`` on every process (a decision made once, e.g. from free disk)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sums (or maxes, ``op="max"``) ``tensor`` over the processes, in place."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return tensor

    def any(self, flag: bool, device: torch.device | str = "cpu") -> bool:
        """True on every process when ``flag`` is true on any (so all stop at the same step)."""
        if not self.distributed:
            return flag
        return bool(self.all_reduce_(torch.tensor([float(flag)], device=device), op="max").item())

    def broadcast_parameters_(self, module: nn.Module) -> None:
        """Every process starts from the main process's weights (guards against any init drift)."""
        if self.distributed:
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor.data, src=0)

    def sum_gradients_(self, params: Sequence[nn.Parameter]) -> None:
        """Sums ``params``' gradients over the processes (one flat all-reduce).

        A process that computed no gradient for a parameter contributes zeros; a parameter no process
        computed a gradient for keeps ``grad = None``, exactly as in a one-process run (AdamW skips it
        instead of stepping on a zero gradient).
        """
        if not self.distributed or not params:
            return
        device = params[0].device
        present = torch.tensor([float(p.grad is not None) for p in params], device=device)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
        self.all_reduce_(present)
        self.all_reduce_(flat)
        offset = 0
        for param, seen in zip(params, present.tolist()):
            count = param.numel()
            if seen:
                param.grad = flat[offset : offset + count].view_as(param).to(param.dtype).clone()
            else:
                param.grad = None
            offset += count


# ----------------------------------------------------------------------------- atomic files
def _temporary(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def _write_atomically(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Runs ``write(temporary)`` then renames the temporary file to ``path``: readers see the old file
    or the new one, never half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to ``path`` through a temporary file and a rename."""
    return _write_atomically(path, lambda tmp: torch.save(obj, tmp))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Writes ``text`` to ``path`` through a temporary file and a rename."""
    return _write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")


__all__ = ["Ranks", "atomic_torch_save", "atomic_write_json", "atomic_write_text"]
