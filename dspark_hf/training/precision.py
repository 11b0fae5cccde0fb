"""The precision of the draft's matmuls in training: float32, or bfloat16 where the machine runs it faster.

Most of a training step is the draft-vocabulary-wide matmuls: the draft's logits and their backward,
the target's logits over the same ids, the Markov head's bias (docs/training.md, "Where a training
step's time goes"). CPUs with bfloat16 dot products (AVX512-BF16 on AMD Zen 4, AMX on recent Intel
Xeons) run them two to three times faster in bfloat16; CPUs without run them slower than float32.
``"auto"`` therefore times the widest of them in both precisions on this device, once per run, and
takes bfloat16 only when it is clearly faster. Under bfloat16 the matmuls run in autocast; the
softmaxes, the loss terms and the optimiser stay float32, and the draft's weights are float32.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

__all__ = ["BF16_MIN_SPEEDUP", "MIN_PROBE_SECONDS", "PRECISIONS", "precision_context", "resolve_precision"]

PRECISIONS = ("auto", "float32", "bfloat16")
BF16_MIN_SPEEDUP = 1.3  # "auto" takes bfloat16 when the probe runs at least this much faster in it
MIN_PROBE_SECONDS = 1e-3  # a float32 probe faster than this: too small a draft for the choice to matter


def precision_context(precision: str, device: torch.device):
    """Autocast to bfloat16 for ``precision`` "bfloat16", else nothing (resolve "auto" first)."""
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision {precision!r}: give float32 or bfloat16 here ({', '.join(PRECISIONS)} in a "
                         "TrainingConfig; resolve_precision turns auto into one of them).")
    if precision == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm-up: kernel choice, allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def resolve_precision(precision: str, device: torch.device, *, rows: int, hidden: int, vocab: int) -> tuple[str, str]:
    """``(precision, why)``: ``precision`` itself unless it is "auto". On the CPU "auto" times a
    ``(rows, hidden) x (hidden, vocab)`` matmul (a step's widest, the draft's logits) in float32 and
    bfloat16 and takes bfloat16 when it is at least :data:`BF16_MIN_SPEEDUP` times faster (float32 when
    the float32 one takes under :data:`MIN_PROBE_SECONDS`: a tiny draft, where the choice is noise). On a GPU
    "auto" is float32 here: the accelerator's mixed precision (the target's half dtype) applies as before."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose from {', '.join(PRECISIONS)}.")
    if precision != "auto":
        return precision, "asked for"
    if device.type != "cpu":
        return "float32", "auto on a GPU: the accelerator's mixed precision applies"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=generator)
    w = torch.randn(vocab, hidden, generator=generator)
    x16, w16 = x.bfloat16(), w.bfloat16()
    fp32 = _median_seconds(lambda: F.linear(x, w))
    bf16 = _median_seconds(lambda: F.linear(x16, w16))
    if fp32 < MIN_PROBE_SECONDS:
        return "float32", f"auto: a {rows}x{hidden}x{vocab} matmul takes {fp32 * 1e6:.0f} us, too little to matter"
    speedup = fp32 / max(bf16, 1e-9)
    chosen = "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"
    return chosen, (f"auto: a {rows}x{hidden}x{vocab} matmul took {fp32 * 1e3:.1f} ms in float32 and "
                    f"{bf16 * 1e3:.1f} ms in bfloat16 on this machine ({speedup:.2f}x; bfloat16 from "
                    f"{BF16_MIN_SPEEDUP}x)")
