"""Packed weights on 2 MB pages (Linux transparent huge pages).

A decode step streams every packed weight from memory once. On 4 KB pages that stream crosses a page
boundary every 4 KB (SmolLM2-135M's float32 copies span about 135,000 pages, far more than the TLB
holds), and the CPU's hardware prefetchers stop at page boundaries. :func:`optimize_for_cpu` therefore
copies the row-block kernel's packed weights into one buffer that starts on a 2 MB boundary and asks
Linux to back it with huge pages (``madvise(MADV_HUGEPAGE)``). Prepared SmolLM2 steps take a few percent
less time than on ordinary pages, in float32 and bfloat16 (``benchmarks/huge_pages.py``; measured:
docs/performance.md).

The bytes are copied unchanged, so results are the same bit for bit; only where the weights live changes.
Where Linux offers no transparent huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``never``, or another system) the copies stay where they were, and that is logged. The kernel may still
back the buffer with 4 KB pages when it has no free 2 MB ones; nothing else changes then. A layer whose
weight changes after packing packs it again into ordinary memory (its old slot in the buffer stays
allocated until the model is freed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

from dspark_hf.machine import THP_SETTING, transparent_huge_pages_mode

HUGE_PAGE_BYTES = 2 * 2**20
_THP_SETTING = THP_SETTING
_MADV_HUGEPAGE = 14  # <linux/mman.h>
_ALIGNMENT = 64  # each tensor in the buffer starts on a cache line
_MARK = "_dspark_on_huge_pages"


def huge_pages_unavailable_reason() -> str | None:
    """Why packed weights cannot be put on transparent huge pages here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"transparent huge pages are a Linux feature (this is {sys.platform})"
    mode = transparent_huge_pages_mode(_THP_SETTING)
    if mode is None:
        return f"{_THP_SETTING} cannot be read or names no mode"
    if mode not in ("always", "madvise"):
        return f"transparent huge pages are off ({_THP_SETTING}: [{mode}])"
    if _madvise() is None:
        return "the C library's madvise cannot be found"
    return None


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised ``uint8`` tensor of ``nbytes`` that starts on a 2 MB boundary and is advised for huge
    pages (before anything touches it, so the pages it gets on first write are 2 MB ones where the kernel has them).
    Raises ``OSError`` when ``madvise`` fails; check :func:`huge_pages_unavailable_reason` first."""
    spanned = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    raw = torch.empty(spanned + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    if _madvise()(raw.data_ptr() + offset, spanned, _MADV_HUGEPAGE) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"madvise(MADV_HUGEPAGE) failed on a {spanned / 2**20:.0f} MB buffer")
    return raw[offset:offset + nbytes]


def copy_to_huge_pages(tensors: list[torch.Tensor], replace) -> int:
    """Copies the contiguous CPU tensors in ``tensors`` into one :func:`huge_page_buffer`, in order, and calls
    ``replace(old, new)`` right after each copy. The list lets go of each tensor as it is copied (its entry becomes
    None), so once ``replace`` has dropped the caller's references the old memory is freed before the next copy:
    the memory in use grows by one tensor at most. Returns the bytes of the buffer."""
    offsets, total = [], 0
    for tensor in tensors:
        if not (tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.is_contiguous()):
            raise ValueError("copy_to_huge_pages takes contiguous, strided CPU tensors")
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // _ALIGNMENT) * _ALIGNMENT
    buffer = huge_page_buffer(total)
    for index, offset in enumerate(offsets):
        tensor, tensors[index] = tensors[index], None
        copy = buffer[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        setattr(copy, _MARK, True)
        replace(tensor, copy)
        del tensor
    return total


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one of the copies :func:`copy_to_huge_pages` made."""
    return getattr(tensor, _MARK, False)


__all__ = ["HUGE_PAGE_BYTES", "copy_to_huge_pages", "huge_page_buffer", "huge_pages_unavailable_reason",
           "on_huge_pages", "transparent_huge_pages_mode"]
