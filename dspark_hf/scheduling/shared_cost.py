"""The live cost model the default scheduler uses: one per target, batch size and process.

:func:`shared_cost_model` builds a :class:`~dspark_hf.scheduling.cost_model.StepCostModel` from the
longest step-rate table cached on disk for that target and batch size, and keeps it for every later
call. It never runs the model: a call must not make its user wait for a profile. Without a cached
table the prior is estimated (:func:`estimated_step_seconds`): a batch of R rows starts from the
one-row model's current curve, and the one-row model from a generic curve. Only the shape of
``T(B)`` steers the scheduler (it compares ``E * SPS(B)`` across ``B``), and the call's own verify
forwards correct it round by round; when the call ends the corrected curve is written to the
cache (:func:`profile_rewrites_per_call`), so the next process starts from it.
``dspark-hf profile`` measures the curves ahead of time for those who want them measured.

A batch of R rows has its own cost model (``rows=R``): a forward of R rows x W tokens also attends
over R contexts and costs more than a one-row forward of as many tokens (docs/scheduling.md),
which a table keyed by token count alone would misread as drift.
When live times drift far from a measured profile, :class:`_ProfileDrift` warns (once per target
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

__all__ = ["DEFAULT_PROFILE_TOKENS", "cost_model_covering", "estimated_step_seconds", "profile_rewrites_per_call",
           "shared_cost_model"]

DEFAULT_PROFILE_TOKENS = 16
# The generic prior of a target without any table: T(B) = T(1) * (1 + GROWTH * (B - 1)). Only the
# growth steers the scheduler. On CPU it sits between the stock and the prepared SmolLM2 curves
# measured on an AMD Zen 4 (docs/performance.md), not yet on Intel; on CUDA it is a guess for a
# forward below its compute bound. Either way the rounds correct it.
ESTIMATE_GROWTH_PER_TOKEN = {"cpu": 0.06, "cuda": 0.01}
# The level: the weights streamed once per forward at this many bytes per second (read only by
# displays and the drafting gate's marker; the scheduler's choices do not depend on it).
ESTIMATE_BYTES_PER_SECOND = {"cpu": 20e9, "cuda": 1e12}
# Verified rounds a cost model on an estimated prior needs before its curve is worth caching.
MIN_ROUNDS_TO_SAVE = 8
_shared_cost_models: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, StepCostModel]]" = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()
# Cost models on an estimated prior -> the observation count their curve was last cached at.
_estimated_models: "weakref.WeakKeyDictionary[StepCostModel, int]" = weakref.WeakKeyDictionary()


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
        if cost_model.estimated:  # an estimate is expected to move; its curve is cached when the call ends
            logger.debug("The live step times moved x%.2f from the estimated prior after %d rounds.",
                         cost_model.drift(), cost_model.num_observations)
            return
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
        """Writes the live estimate into the cache file the prior came from. A measured prior is
        replaced size by size, only where the live times are faster: load makes a run slower for a
        while, and a profile slowed by it would mislead every later quiet run until their own
        rounds corrected it (a live run still corrects a profile that is too fast, every time). An
        estimated prior is replaced whole: the rounds measured more than the estimate knew."""
        length = cost_model.prior_length
        live = cost_model.step_seconds(length)
        updated = dict(self.record)
        if cost_model.estimated:
            fitted = live
            updated["estimated"] = True
            updated["observed_sizes"] = cost_model.observed_sizes()
        else:
            prior = [cost_model.prior(b) for b in range(1, length + 1)]
            if all(t >= p for t, p in zip(live, prior)):
                return
            fitted = [min(t, p) for t, p in zip(live, prior)]
        updated["fitted_step_seconds"] = fitted
        updated["sps"] = [1.0 / t for t in fitted]
        for i in range(1, length):  # rounding in 1/t must not break monotonicity
            updated["sps"][i] = min(updated["sps"][i], updated["sps"][i - 1])
        updated["live_corrected"] = {"observations": cost_model.num_observations, "updated_unix": time.time()}
        step_rates._write_record(self.path, updated)
        self.record = updated


def _save_estimated_curves() -> None:
    """Caches the live curve of every cost model on an estimated prior that verified enough rounds
    since its curve was last cached."""
    with _shared_lock:
        due = [model for model, saved in _estimated_models.items()
               if model.num_observations >= max(MIN_ROUNDS_TO_SAVE, saved + 1)]
        for model in due:
            _estimated_models[model] = model.num_observations
    for model in due:
        if isinstance(model.on_drift, _ProfileDrift):
            model.on_drift.rewrite(model)


@contextlib.contextmanager
def profile_rewrites_per_call() -> Iterator[None]:
    """Scope of one generate call (the dispatch runs every DSpark call in it): drift reports of the
    shared cost models mark their cache file, and each marked file is rewritten once when the call
    ends; the curves of cost models on an estimated prior are cached then too. Nested scopes belong
    to the outermost. Thread-local, as cost-model observations are made by the thread running the
    call."""
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
        _save_estimated_curves()


def estimated_step_seconds(model: torch.nn.Module, length: int, *, known: StepCostModel | None = None) -> list[float]:
    """A prior for ``T(B)``, ``B = 1..length``, made without running ``model``.

    With ``known`` (the one-row cost model, when estimating a batch's) its current curve: what
    the one-row rounds or profile measured, extended past its table by its affine tail. Otherwise a
    generic curve, ``T(1) * (1 + g * (B - 1))`` with the growth ``g`` of
    :data:`ESTIMATE_GROWTH_PER_TOKEN` for the device and ``T(1)`` the weights' bytes over
    :data:`ESTIMATE_BYTES_PER_SECOND`. The scheduler reads only the curve's shape; the rounds
    correct both.
    """
    if known is not None:
        return known.step_seconds(length)
    device = step_rates._model_device(model).type
    growth = ESTIMATE_GROWTH_PER_TOKEN.get(device, ESTIMATE_GROWTH_PER_TOKEN["cuda"])
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    one_token = max(weight_bytes, 1) / ESTIMATE_BYTES_PER_SECOND.get(device, ESTIMATE_BYTES_PER_SECOND["cuda"])
    return [one_token * (1.0 + growth * (b - 1)) for b in range(1, length + 1)]


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

    Built once per target, batch size, process and environment (see
    :func:`~dspark_hf.scheduling.step_rates.sps_cache_key`) from the longest step-rate table cached
    on disk (``dspark-hf profile`` measures one ahead of time; calls cache their corrected curves),
    or else from an estimate (:func:`estimated_step_seconds`; ``profile_tokens`` sizes long). It
    never runs the model. The observed verify times correct it. When the live times drift far from
    a measured profile, a warning is logged (once per target and process) and the cache file is
    rewritten with the faster of the two (once per generate call, see
    :func:`profile_rewrites_per_call`). On a target with few positions
    (:func:`~dspark_hf.scheduling.step_rates.max_positions`), the table is shortened to fit them:
    at most half of them new tokens, the context the rest.

    ``rows`` > 1 gives the cost model of batched rounds of that many rows: keyed by the total tokens
    of the forward like the one-row model, cached and corrected apart from it, its estimate taken
    from the one-row model's curve. ``progress`` is accepted for compatibility (nothing is profiled).
    """
    directory = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "sps"
    limit = step_rates.max_positions(model)
    if limit is not None:  # a target with few positions (learned absolute ones) gets a shorter table
        profile_tokens = max(rows, min(profile_tokens, rows * max(1, limit // 2)))
    context_length = step_rates.fitted_context_length(model, context_length, -(-profile_tokens // rows))
    base_key = step_rates._base_key(model, context_length, rows)
    with _shared_lock:
        cost_model = _shared_cost_models.get(model, {}).get(base_key)
    if cost_model is not None:
        return cost_model
    found = _longest_cached_profile(directory, base_key) if directory.is_dir() else None
    # Outside the lock (the one-row model may be built first), and only when there is no table to start from.
    known = shared_cost_model(model, cache_dir=cache_dir) if rows > 1 and found is None else None
    with _shared_lock:
        per_model = _shared_cost_models.setdefault(model, {})
        cost_model = per_model.get(base_key)
        if cost_model is not None:
            return cost_model
        if found is None:
            path = directory / f"{base_key}-b{profile_tokens}.json"
            prior, record, estimated = estimated_step_seconds(model, profile_tokens, known=known), {}, True
            logger.info("No step-rate table cached for this target (rows=%d); the scheduler starts from an "
                        "estimate that its rounds correct, and caches the corrected curve under %s.", rows, path)
        else:
            sps, path = found
            record = _read_record(path, sps)
            prior, estimated = [1.0 / rate for rate in sps], bool(record.get("estimated", False))
            logger.info("Using the cached SPS table %s as the cost model's prior.", path)
        record.setdefault("environment", step_rates._environment(model))
        record.setdefault("rows", rows)
        record.setdefault("context_length", context_length)
        cost_model = StepCostModel(prior, on_drift=_ProfileDrift(model, path, record), estimated=estimated)
        if estimated:
            _estimated_models[cost_model] = 0
        per_model[base_key] = cost_model
        return cost_model


def cost_model_covering(model: torch.nn.Module, max_tokens: int, *, cache_dir: str | os.PathLike | None = None,
                        progress: bool = True, rows: int = 1) -> StepCostModel:
    """The shared cost model of ``model`` for forwards of up to ``max_tokens`` tokens in ``rows`` rows.

    A batched round verifies ``rows x (1 + longest proposal)`` tokens (padding included). A model
    first built here gets a prior of that length; a cached table that is shorter reads past its end
    along its affine tail (:meth:`~dspark_hf.scheduling.cost_model.StepCostModel.prior`), which the
    rounds correct. Nothing is profiled. On a target with few positions the prior stops at half of
    them. ``progress`` is accepted for compatibility.
    """
    limit = step_rates.max_positions(model)
    if limit is not None:
        max_tokens = min(max_tokens, rows * max(1, limit // 2))
    if rows > 1:
        return shared_cost_model(model, cache_dir=cache_dir, rows=rows, profile_tokens=max(max_tokens, rows))
    return shared_cost_model(model, cache_dir=cache_dir)
