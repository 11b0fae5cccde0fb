"""The target's step rate ``SPS(B)``: profiling, its disk cache, and the live cost model per target.

``SPS(B)`` is the target engine's steps per second when one forward pass processes ``B`` tokens;
the prefix scheduler (:mod:`dspark_hf.scheduling.policies`) weighs expected accepted tokens against it.
:func:`profile_sps` measures it for a transformers causal LM the way a verify step really runs
(``B`` new tokens on top of a cached context) and caches the table on disk;
:mod:`dspark_hf.scheduling.shared_cost` keeps one live :class:`~dspark_hf.scheduling.cost_model.StepCostModel`
per target and process, built from the longest cached profile this module wrote.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging

from ..cache_dir import default_cache_dir
from ..engine_hooks import backend_fingerprint
from ..machine import cpu_model
from .cost_model import monotone_step_times

logger = logging.get_logger(__name__)

__all__ = [
    "fitted_context_length",
    "load_sps_profile",
    "max_positions",
    "profile_sps",
    "sps_cache_key",
]


def _model_device(model: torch.nn.Module) -> torch.device:
    # With an accelerate device_map the inputs must go where the input embeddings live.
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    return torch.device(getattr(model, "device", "cpu"))


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(model.parameters()).dtype


def _vocab_size(model: torch.nn.Module) -> int:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    num = getattr(embeddings, "num_embeddings", None)
    if isinstance(num, int) and num > 0:
        return num
    return int(model.config.get_text_config().vocab_size)


def _environment(model: torch.nn.Module) -> dict[str, Any]:
    import transformers

    device = _model_device(model)
    env: dict[str, Any] = {
        "model_type": getattr(model.config, "model_type", None),
        "name_or_path": getattr(model.config, "_name_or_path", None),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "device_type": device.type,
        "device_name": None,
        "dtype": str(_model_dtype(model)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "num_threads": None,
        # How an engine prepared the model (the CPU engine: packed linears change the curve's shape, the lean
        # forward its level, a kernel change moves it), so each preparation gets its own profile; {} when stock.
        "backend": backend_fingerprint(model),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        env["device_name"] = cpu_model()
        env["num_threads"] = torch.get_num_threads()
    return env


# Config fields bounding the positions a model takes. Learned absolute position tables (GPT-2,
# OPT, GPT-J) raise IndexError past them, so a profile's context plus new tokens must fit.
_POSITION_LIMIT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def max_positions(model: torch.nn.Module) -> int | None:
    """The most positions ``model`` takes, from its (text) config, or ``None`` when it names none."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in _POSITION_LIMIT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def fitted_context_length(model: torch.nn.Module, context_length: int, max_tokens: int) -> int:
    """``context_length`` shortened so that the context plus ``max_tokens`` new tokens fit the
    target's positions (:func:`max_positions`); ``ValueError`` when ``max_tokens`` alone fills them."""
    limit = max_positions(model)
    if limit is None or context_length + max_tokens <= limit:
        return context_length
    if max_tokens >= limit:
        raise ValueError(
            f"profile_sps: max_tokens={max_tokens} new tokens on top of a cached context do not fit this target's "
            f"{limit} positions (max_position_embeddings / n_positions); pass max_tokens below {limit}."
        )
    return limit - max_tokens


def _base_key(model: torch.nn.Module, context_length: int, rows: int = 1) -> str:
    # Everything that affects the step time except max_tokens; the config includes _name_or_path.
    # A batched profile (rows > 1) gets its own key: R rows attend over R contexts.
    payload = {
        "config": model.config.to_dict(),
        "environment": _environment(model),
        "context_length": context_length,
    }
    blob = json.dumps(payload, sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode("utf-8")).hexdigest()[:24]
    return digest if rows == 1 else f"{digest}-r{rows}"


def sps_cache_key(model: torch.nn.Module, max_tokens: int, *, context_length: int = 256, rows: int = 1) -> str:
    """The on-disk cache key :func:`profile_sps` uses for ``model``.

    It hashes the model config (including ``_name_or_path``), the attention implementation, the
    device (type, and the GPU's or CPU's model name), the dtype, how an engine prepared the model
    (:func:`dspark_hf.engine_hooks.backend_fingerprint`: for the CPU engine's ``optimize_for_cpu``, packed linears
    with a digest of the kernels' code, and the lean decoder), the torch and transformers
    versions, ``context_length`` and, on CPU, ``torch.get_num_threads()``; ``max_tokens`` is appended as
    ``-b<max_tokens>``, and a batched profile's ``rows`` before it as ``-r<rows>``. ``context_length``
    is first fitted to the target's positions (:func:`fitted_context_length`), as :func:`profile_sps` does.
    """
    per_row = -(-max_tokens // rows)  # as profile_sps fits the context: the new tokens of one row
    return f"{_base_key(model, fitted_context_length(model, context_length, per_row), rows)}-b{max_tokens}"


def _valid_table(values: Any, min_length: int) -> bool:
    if not isinstance(values, list) or len(values) < min_length or min_length < 1:
        return False
    # bool is an int subclass; an int beyond float range makes math.isfinite raise OverflowError.
    # A rate must also give a positive finite step time: 1 / 1e-310 overflows to inf.
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and _finite_positive(v)
               and _finite_positive(1.0 / v) for v in values):
        return False
    return all(values[i] <= values[i - 1] for i in range(1, len(values)))


def _finite_positive(value: int | float) -> bool:
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:
        return False


def _load_cached(directory: Path, base_key: str, max_tokens: int) -> tuple[list[float], Path] | None:
    """Finds a cached table for ``base_key`` covering ``max_tokens``: the exact key first, else
    the shortest longer table, truncated."""
    exact = directory / f"{base_key}-b{max_tokens}.json"
    paths = [exact] if exact.is_file() else []
    others = []
    for path in directory.glob(f"{base_key}-b*.json"):
        try:
            length = int(path.stem.rsplit("-b", 1)[1])
        except (IndexError, ValueError):
            continue
        if length > max_tokens:
            others.append((length, path))
    paths += [path for _, path in sorted(others)]
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError, RecursionError) as error:  # RecursionError: absurdly deep nesting
            logger.warning("Ignoring unreadable SPS cache file %s (%s); it will be replaced.", path,
                           type(error).__name__ if isinstance(error, RecursionError) else error)
            continue
        table = record.get("sps") if isinstance(record, dict) else None
        if _valid_table(table, max_tokens):
            return [float(v) for v in table[:max_tokens]], path
        logger.warning("Ignoring invalid SPS cache file %s (step rates must be positive, non-increasing and give "
                       "finite step times); it will be replaced.", path)
    return None


def load_sps_profile(model: torch.nn.Module, max_tokens: int, *, context_length: int = 256,
                     cache_dir: str | os.PathLike | None = None) -> dict | None:
    """The cached profile record :func:`profile_sps` wrote for ``model`` (raw median step times,
    fitted times, the table, the environment), or ``None`` if there is none covering ``max_tokens``."""
    directory = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "sps"
    if not directory.is_dir():
        return None
    found = _load_cached(directory, _base_key(model, fitted_context_length(model, context_length, max_tokens)),
                         max_tokens)
    if found is None:
        return None
    with open(found[1], encoding="utf-8") as f:
        return json.load(f)


def _cache_kwarg_name(model: torch.nn.Module) -> str:
    """The forward keyword for the KV cache: ``cache`` in transformers 5.24 (where
    ``past_key_values`` is a deprecated alias that warns), ``past_key_values`` elsewhere."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    if "cache" in parameters:
        return "cache"
    return "past_key_values"


class _VerifyStepTimer:
    """Times ``model(B new tokens)`` on top of a cached context, as a verify step runs; with
    ``rows`` > 1, ``B`` tokens are ``rows`` rows of ``B / rows``, each row on its own context."""

    def __init__(self, model: torch.nn.Module, context_length: int, max_tokens: int, rows: int = 1) -> None:
        self.model = model
        self.context_length = context_length
        self.device = _model_device(model)
        self.cache_class = DynamicCache
        self.cache_kwarg = _cache_kwarg_name(model)
        try:
            parameters = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            parameters = {}
        self.pass_logits_to_keep = "logits_to_keep" in parameters

        generator = torch.Generator().manual_seed(0)
        vocab = _vocab_size(model)
        self.rows = rows
        self.context_ids = torch.randint(0, vocab, (rows, context_length), generator=generator).to(self.device)
        self.new_ids = torch.randint(0, vocab, (rows, -(-max_tokens // rows)), generator=generator).to(self.device)
        self.reprefill = False  # set when the cache cannot be rolled back by cropping
        self.cache = self._prefill()

    def _new_cache(self) -> Any:
        try:
            return self.cache_class(config=self.model.config)
        except TypeError:
            return self.cache_class()

    def _forward(self, input_ids: torch.Tensor, cache: Any) -> Any:
        kwargs: dict[str, Any] = {"input_ids": input_ids, self.cache_kwarg: cache, "use_cache": True}
        if self.pass_logits_to_keep:
            kwargs["logits_to_keep"] = input_ids.shape[1]
        return self.model(**kwargs)

    def _prefill(self) -> Any:
        cache = self._new_cache()
        self._forward(self.context_ids, cache)
        # Let fixed-size layers (sliding window) keep what a later crop needs to roll back.
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        return cache

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _rewind(self, num_new: int) -> None:
        if self.reprefill:
            self.cache = self._prefill()
            return
        try:
            # transformers 5.x: crop(-n) removes the last n tokens (a positive value is
            # rejected there); older versions read a negative value the same way.
            self.cache.crop(-num_new)
            ok = self.cache.get_seq_length() == self.context_length
        except Exception as error:  # caches that cannot be cropped (e.g. linear attention)
            logger.info("Cache crop failed (%s); re-prefilling the context before each step.", error)
            ok = False
        if not ok:
            self.reprefill = True
            self.cache = self._prefill()

    def time_step(self, num_tokens: int) -> float:
        """Seconds for one forward of ``num_tokens`` new tokens (all rows); the cache is rolled back after."""
        width = num_tokens // self.rows
        input_ids = self.new_ids[:, :width]
        self._sync()
        start = time.perf_counter()
        output = self._forward(input_ids, self.cache)
        self._sync()
        elapsed = time.perf_counter() - start
        del output
        self._rewind(width)
        return elapsed


def profile_sps(
    model: torch.nn.Module,
    max_tokens: int,
    *,
    context_length: int = 256,
    warmup: int = 2,
    repeats: int = 7,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    progress: bool = True,
    dense_up_to: int = 16,
    stride: int = 8,
    rows: int = 1,
) -> list[float]:
    """Measures the target's step rate ``SPS(B)`` for ``B = 1..max_tokens`` new tokens.

    Each measurement runs the forward a verify step runs in transformers: ``B`` random token ids
    on top of a ``transformers.DynamicCache`` prefilled with ``context_length`` random tokens,
    ``use_cache=True``, ``logits_to_keep=B``, under ``torch.inference_mode()``; the cache is
    cropped back to the context afterwards. After ``warmup`` untimed rounds, ``repeats`` rounds
    each visit every ``B`` once in a shuffled order (seeded), so drift of the machine hits all
    ``B`` alike. Per ``B`` the median time is taken; the medians are made non-decreasing with
    :func:`monotone_step_times` (a noisy dip is pooled with its neighbours, a real cliff is
    kept), and ``SPS(B) = 1 / time(B)``.

    The result is cached as JSON under ``<cache_dir>/sps/<key>.json`` (key: see
    :func:`sps_cache_key`) with the raw medians, the fitted times, the table and the environment.
    With ``use_cache=True`` a cached table for the same model/environment whose length covers
    ``max_tokens`` is reused (truncated to ``max_tokens``) without running the model; a fresh
    measurement is always written back.

    Args:
        model: a transformers causal LM (the target). Inputs are placed on the device of its input
            embeddings, which also works for models dispatched with an accelerate ``device_map``.
        max_tokens: largest ``B`` to measure (e.g. ``R * (gamma + 1)``).
        context_length: tokens already in the KV cache when the step runs; shortened when it
            and ``max_tokens`` would not fit the target's positions (:func:`fitted_context_length`).
        warmup: untimed rounds over all ``B`` first.
        repeats: timed rounds over all ``B``.
        cache_dir: cache root; defaults to ``$DSPARK_HF_CACHE`` or ``~/.cache/dspark_hf``.
        use_cache: reuse a cached table when there is one.
        progress: show a tqdm progress bar.
        dense_up_to, stride: every ``B`` up to ``dense_up_to`` is measured, beyond it every
            ``stride``-th and ``max_tokens`` (large tables for batched decoding), with step times
            interpolated linearly in between; ``median_step_seconds`` in the cache file holds the
            interpolated values and ``measured_sizes`` the measured ``B``.
        rows: the batch the forwards run with: ``B`` tokens are ``rows`` rows of ``B / rows``
            tokens, each row on its own ``context_length``-token context (a batched verify forward,
            whose cost also grows with the contexts it attends over). Only multiples of ``rows``
            are measured (a batched round's padded forward is one); sizes between take the next
            measured time below them (the least a forward of that many tokens over ``rows`` rows
            can cost), sizes below ``rows`` the time of ``rows``. Cached under its own key.

    Returns:
        ``sps`` with ``sps[B - 1]`` = steps per second for ``B`` tokens; positive, non-increasing,
        of length ``max_tokens``.
    """
    for name, value, minimum in (
        ("max_tokens", max_tokens, 1),
        ("context_length", context_length, 1),
        ("warmup", warmup, 0),
        ("repeats", repeats, 1),
        ("dense_up_to", dense_up_to, 1),
        ("stride", stride, 1),
        ("rows", rows, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"profile_sps: {name} must be an integer >= {minimum}, got {value!r}.")

    directory = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    directory = directory / "sps"
    if max_tokens < rows:
        raise ValueError(f"profile_sps: max_tokens ({max_tokens}) must reach at least one token per row (rows={rows}).")
    context_length = fitted_context_length(model, context_length, -(-max_tokens // rows))
    base_key = _base_key(model, context_length, rows)
    key = f"{base_key}-b{max_tokens}"

    if use_cache and directory.is_dir():
        found = _load_cached(directory, base_key, max_tokens)
        if found is not None:
            table, path = found
            logger.info("Using the cached SPS table %s.", path)
            return table

    environment = _environment(model)
    logger.info(
        "Profiling the target step rate SPS(B) for B = 1..%d new tokens in %d row(s), each on a %d-token cached "
        "context (%s, %s, %d warm-up + %d timed rounds); the table is cached under %s.",
        max_tokens,
        rows,
        context_length,
        environment["device_type"] if environment["device_name"] is None else environment["device_name"],
        environment["dtype"],
        warmup,
        repeats,
        directory,
    )

    # Every B up to `dense_up_to` (where a CPU's kernels switch paths and the curve is jagged),
    # then every `stride`-th B and the last one; step time is interpolated linearly in between.
    if rows == 1:
        sizes = list(range(1, min(max_tokens, dense_up_to) + 1))
        sizes += [b for b in range(dense_up_to + stride, max_tokens, stride)] + ([max_tokens] if max_tokens > dense_up_to else [])
    else:  # every width a batched round can use: rows x 1, rows x 2, ...
        sizes = [rows * width for width in range(1, max_tokens // rows + 1)]
    samples: dict[int, list[float]] = {b: [] for b in sizes}
    order_rng = random.Random(0)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            timer = _VerifyStepTimer(model, context_length, max_tokens, rows)
            with tqdm(total=(warmup + repeats) * len(sizes), desc="Profiling SPS", disable=not progress) as bar:
                for round_index in range(warmup + repeats):
                    order = sizes[:]
                    order_rng.shuffle(order)
                    for num_tokens in order:
                        elapsed = timer.time_step(num_tokens)
                        if round_index >= warmup:
                            samples[num_tokens].append(elapsed)
                        bar.update(1)
            del timer
    finally:
        model.train(was_training)

    measured = {b: statistics.median(samples[b]) for b in sizes}
    medians = []
    for b in range(1, max_tokens + 1):
        if b in measured:
            medians.append(measured[b])
        elif rows > 1:  # between padded sizes: the measured size below (sizes below rows: rows x 1)
            medians.append(measured[max([m for m in sizes if m <= b], default=sizes[0])])
        else:
            lo = max(m for m in sizes if m < b)
            hi = min(m for m in sizes if m > b)
            medians.append(measured[lo] + (measured[hi] - measured[lo]) * (b - lo) / (hi - lo))
    # A zero time (coarse clock) would give an infinite rate; floor it at the clock resolution.
    floor = time.get_clock_info("perf_counter").resolution or 1e-9
    fitted = [max(t, floor) for t in monotone_step_times(medians)]
    sps = [1.0 / t for t in fitted]
    # Guard against rounding in 1/t breaking monotonicity.
    for i in range(1, len(sps)):
        sps[i] = min(sps[i], sps[i - 1])

    record = {
        "format": 1,
        "key": key,
        "max_tokens": max_tokens,
        "rows": rows,
        "context_length": context_length,
        "warmup": warmup,
        "repeats": repeats,
        "measured_sizes": sizes,
        "median_step_seconds": medians,
        "fitted_step_seconds": fitted,
        "sps": sps,
        "environment": environment,
        "created_unix": time.time(),
    }
    _write_record(directory / f"{key}.json", record)
    return sps


def _write_record(path: Path, record: dict) -> bool:
    """Writes a profile record atomically; a cache that cannot be written is logged, not fatal."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        os.replace(temporary, path)
        return True
    except OSError as error:
        logger.warning("Could not write the SPS cache file %s (%s).", path, error)
        return False

