"""The live cost model the default scheduler uses: one per target and process.

:func:`shared_cost_model` builds a :class:`~dspark_hf.scheduling.cost_model.StepCostModel` from the
longest SPS profile cached on disk (:mod:`dspark_hf.scheduling.step_rates` writes them), or from a
fresh short profile, and keeps it for every later call on that target. :func:`cost_model_covering`
makes its profiled prior reach the token counts of a batched round (``rows x (1 + longest
proposal)``), profiling the missing sizes once (cached) instead of extrapolating far beyond the
table. A batch of R rows has its own cost model (``rows=R``), profiled with R rows: a forward of
R rows x W tokens also attends over R contexts, and measured 1.3-1.4x a one-row forward of as many
tokens (R = 8 and 16, SmolLM2 on CPU), which a table keyed by token count alone misread as drift.
When live times drift far from the profile, :class:`_ProfileDrift` warns (once per target
and process) and rewrites the cache file, never with slower times than it held: a run under load
must not leave a profile that misleads later quiet runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.utils import logging

from ..cache_dir import default_cache_dir
from . import step_rates
from .cost_model import StepCostModel

logger = logging.get_logger(__name__)

__all__ = ["DEFAULT_PROFILE_TOKENS", "cost_model_covering", "profile_rewrites_per_call", "shared_cost_model"]

DEFAULT_PROFILE_TOKENS = 16
# A batched model's profile (every width, rows x 1 .. rows x W): one warm-up and five timed rounds.
BATCHED_WARMUP, BATCHED_REPEATS = 1, 5
# Beyond the dense part, a batched extension measures every EXTENSION_STRIDE-th size with few rounds:
# the live correction refines it, and a user's first batched call should not wait a minute.
EXTENSION_STRIDE, EXTENSION_WARMUP, EXTENSION_REPEATS = 16, 1, 3
_shared_cost_models: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, StepCostModel]]" = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()
_extension_lock = threading.Lock()


def _longest_cached_profile(directory: Path, base_key: str) -> tuple[list[float], Path] | None:
    lengths = []
    for path in directory.glob(f"{base_key}-b*.json"):
        try:
            lengths.append(int(path.stem.rsplit("-b", 1)[1]))
        except (IndexError, ValueError):
            continue
    for length in sorted(set(lengths), reverse=True):
        found = step_rates._load_cached(directory, base_key, length)
        if found is not None:
            return found
    return None


def _read_record(path: Path, sps: list[float]) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError):
        return {"sps": sps}


_drift_warned: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # targets whose drift was logged as a warning
_call_scope = threading.local()  # .pending: {_ProfileDrift: StepCostModel} while a generate call runs


class _ProfileDrift:
    """What a shared cost model does when its live times drift from the profile (its ``on_drift``).

    The first report for a target is a warning; later ones, in any call of this process, are
    debug messages (a model whose times wander around a threshold would otherwise warn on every
    crossing). Inside a generate call (:func:`profile_rewrites_per_call`) the cache file is
    rewritten once, when the call ends, with the latest live estimate; outside one, at once.
    """

    def __init__(self, target: torch.nn.Module, path: Path, record: dict) -> None:
        self._target = weakref.ref(target)
        self.path, self.record = path, record

    def __call__(self, cost_model: StepCostModel) -> None:
        target = self._target()
        with _shared_lock:
            first = target is not None and target not in _drift_warned
            if first:
                _drift_warned.add(target)
        log = logger.warning if first else logger.debug
        log("The target's live step times differ from its profiled SPS table by up to x%.2f after %d rounds "
            "(a profile taken under load, at another context length or on another machine state); the "
            "scheduler uses the live times, and where they are faster the cache file %s is updated with "
            "them (once per generate call; later drift is logged at debug level).",
            cost_model.drift(), cost_model.num_observations, self.path)
        pending = getattr(_call_scope, "pending", None)
        if pending is None:
            self.rewrite(cost_model)
        else:
            pending[self] = cost_model

    def rewrite(self, cost_model: StepCostModel) -> None:
        """Writes the live estimate into the cache file the prior came from, size by size, only
        where it is faster than the profile: load makes a run slower for a while, and a profile
        slowed by it would mislead every later quiet run until their own rounds corrected it (a
        live run still corrects a profile that is too fast, every time)."""
        length = cost_model.prior_length
        live = cost_model.step_seconds(length)
        prior = [cost_model.prior(b) for b in range(1, length + 1)]
        if all(t >= p for t, p in zip(live, prior)):
            return
        fitted = [min(t, p) for t, p in zip(live, prior)]
        updated = dict(self.record)
        updated["fitted_step_seconds"] = fitted
        updated["sps"] = [1.0 / t for t in fitted]
        for i in range(1, length):  # rounding in 1/t must not break monotonicity
            updated["sps"][i] = min(updated["sps"][i], updated["sps"][i - 1])
        updated["live_corrected"] = {"observations": cost_model.num_observations, "updated_unix": time.time()}
        step_rates._write_record(self.path, updated)


@contextlib.contextmanager
def profile_rewrites_per_call() -> Iterator[None]:
    """Scope of one generate call (the dispatch runs every DSpark call in it): drift reports of the
    shared cost models mark their cache file, and each marked file is rewritten once when the call
    ends. Nested scopes belong to the outermost. Thread-local, as cost-model observations are made
    by the thread running the call."""
    if getattr(_call_scope, "pending", None) is not None:
        yield
        return
    _call_scope.pending = {}
    try:
        yield
    finally:
        pending, _call_scope.pending = _call_scope.pending, None
        for drift, cost_model in pending.items():
            drift.rewrite(cost_model)


def shared_cost_model(
    model: torch.nn.Module,
    *,
    profile_tokens: int = DEFAULT_PROFILE_TOKENS,
    context_length: int = 256,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    rows: int = 1,
) -> StepCostModel:
    """The live cost model of ``model`` in this process (what the default scheduler uses).

    Built once per target, process and environment (see :func:`~dspark_hf.scheduling.step_rates.sps_cache_key`),
    from the longest SPS profile cached on disk (``dspark-hf profile`` writes one ahead of time), or
    else from a fresh profile of ``profile_tokens`` tokens (a few seconds). Batched decoding extends
    it to its own token counts (:func:`cost_model_covering`); the observed verify times correct it.
    When the live times drift far from the profile, a warning is logged (once per target and
    process) and the cache file is rewritten with the faster of the two (once per generate call,
    see :func:`profile_rewrites_per_call`). On a target with few positions
    (:func:`~dspark_hf.scheduling.step_rates.max_positions`), the profile is shortened to fit them:
    at most half of them new tokens, the context the rest.

    ``rows`` > 1 gives the cost model of batched rounds of that many rows: keyed by the total tokens
    of the forward like the one-row model, profiled with ``rows`` rows (``profile_tokens`` of them in
    all; see :func:`~dspark_hf.scheduling.step_rates.profile_sps`), cached and corrected apart from it.
    """
    directory = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "sps"
    limit = step_rates.max_positions(model)
    if limit is not None:  # a target with few positions (learned absolute ones) gets a shorter profile
        profile_tokens = max(rows, min(profile_tokens, rows * max(1, limit // 2)))
    context_length = step_rates.fitted_context_length(model, context_length, -(-profile_tokens // rows))
    base_key = step_rates._base_key(model, context_length, rows)
    with _shared_lock:
        per_model = _shared_cost_models.setdefault(model, {})
        cost_model = per_model.get(base_key)
        if cost_model is not None:
            return cost_model
        found = _longest_cached_profile(directory, base_key) if directory.is_dir() else None
        if found is None:
            timing = {} if rows == 1 else {"warmup": BATCHED_WARMUP, "repeats": BATCHED_REPEATS}
            sps = step_rates.profile_sps(model, profile_tokens, context_length=context_length, cache_dir=cache_dir,
                                         use_cache=False, progress=progress, rows=rows, **timing)
            path = directory / f"{base_key}-b{profile_tokens}.json"
        else:
            sps, path = found
            logger.info("Using the cached SPS table %s as the cost model's prior.", path)
        cost_model = StepCostModel([1.0 / rate for rate in sps],
                                   on_drift=_ProfileDrift(model, path, _read_record(path, sps)))
        per_model[base_key] = cost_model
        return cost_model


def cost_model_covering(model: torch.nn.Module, max_tokens: int, *, cache_dir: str | os.PathLike | None = None,
                        progress: bool = True, rows: int = 1) -> StepCostModel:
    """The shared cost model of ``model``, its profiled prior reaching ``max_tokens`` tokens.

    A batched round verifies ``rows x (1 + longest proposal)`` tokens (padding included), far
    beyond the 16 sizes a single-sequence profile holds, where a straight extrapolation from the
    last entry overstates the cost several times (the measured curve bends). The missing sizes are
    profiled once (every size up to 16, then every 16th, few rounds: seconds, with a progress bar),
    cached on disk next to the shorter profile, and become the model's prior; what it learned live
    is kept. On a target with few positions the prior stops at half of them, and beyond it the
    extrapolation and the live correction take over. ``rows`` > 1: the cost model of batches of that
    many rows (:func:`shared_cost_model`), first profiled up to ``max_tokens`` at once.
    """
    limit = step_rates.max_positions(model)
    if limit is not None:
        max_tokens = min(max_tokens, rows * max(1, limit // 2))
    if rows > 1:
        max_tokens = max(max_tokens, rows)
        cost_model = shared_cost_model(model, cache_dir=cache_dir, progress=progress, rows=rows,
                                       profile_tokens=max_tokens)
    else:
        cost_model = shared_cost_model(model, cache_dir=cache_dir, progress=progress)
    if cost_model.prior_length >= max_tokens:
        return cost_model
    with _extension_lock:
        if cost_model.prior_length >= max_tokens:
            return cost_model
        logger.info("Profiling the target's step times up to %d tokens for batched decoding (once; cached).",
                    max_tokens)
        sps = step_rates.profile_sps(model, max_tokens, cache_dir=cache_dir, progress=progress, rows=rows,
                                     warmup=EXTENSION_WARMUP, repeats=EXTENSION_REPEATS, stride=EXTENSION_STRIDE)
        cost_model.extend_prior([1.0 / rate for rate in sps])
        drift = cost_model.on_drift
        if isinstance(drift, _ProfileDrift):  # later rewrites go to the longer file
            directory = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "sps"
            drift.path = directory / f"{step_rates.sps_cache_key(model, max_tokens, rows=rows)}.json"
            drift.record = _read_record(drift.path, sps)
    return cost_model
