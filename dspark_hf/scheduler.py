"""Verification-length policies for DSpark and the target step-rate profiler.

A DSpark round drafts ``gamma`` tokens together with per-position confidences
``c_1..c_gamma`` (``c_k`` = probability that draft position ``k`` is accepted given that
positions ``1..k-1`` were). A *verification policy* decides how many leading draft tokens the
target model verifies this round:

* :class:`PrefixScheduler`: the hardware-aware prefix scheduler of the DSpark paper
  (section 3.2.2, Algorithm 1). It maximises the expected token throughput
  ``Theta = E[accepted tokens] * SPS(B)`` along a greedy admission path, with an early stop
  that keeps speculative decoding lossless.
* :class:`FixedLengthPolicy`: always verify a fixed number of draft tokens (plain DFlash).
* :class:`ThresholdPolicy`: the static threshold on prefix survival ``c_1 * ... * c_k`` used by
  earlier work.
* :class:`PerPositionThresholdPolicy`: DeepSpec's ``--confidence-threshold`` rule, a threshold on
  each position's own confidence ``c_k`` (cut at the first position below it).

``SPS(B)`` is the target engine's steps per second when one forward pass processes ``B`` tokens.
:func:`profile_sps` measures it for a transformers causal LM (the way a verify step really runs:
``B`` new tokens on top of a cached context) and caches the table on disk.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import operator
import os
import random
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging

from .cost_model import StepCostModel, monotone_step_times
from .cpu_fast_path import is_optimized_for_cpu
from .rounds import offer_until_refused


logger = logging.get_logger(__name__)

__all__ = [
    "VerifyPolicy",
    "PrefixScheduler",
    "FixedLengthPolicy",
    "ThresholdPolicy",
    "PerPositionThresholdPolicy",
    "DraftingGate",
    "monotone_step_times",
    "profile_sps",
    "load_sps_profile",
    "sps_cache_key",
    "default_cache_dir",
    "shared_cost_model",
    "StepCostModel",
]


# ---------------------------------------------------------------------------------------------
# Verification policies
# ---------------------------------------------------------------------------------------------


def _as_float_list(values: Sequence[float]) -> list[float]:
    """Returns ``values`` as a list of Python floats (accepts lists, tuples and 1-D tensors)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


def _rate_from_table(table: Sequence[float], num_tokens: int) -> float:
    """``SPS(B)`` from a table, with time growing linearly in ``B`` beyond its end."""
    if num_tokens <= len(table):
        return table[num_tokens - 1]
    return table[-1] * len(table) / num_tokens


def _check_confidence(value: float, position: int) -> None:
    # Written so that NaN fails too (every comparison with NaN is False).
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"Confidence at draft position {position} is {value!r}; confidences must be "
            "probabilities in [0, 1]. Pass the sigmoid outputs of the confidence head."
        )


class VerifyPolicy:
    """Interface of a verification-length policy.

    Attributes:
        requires_confidences: whether the policy looks at the confidence values. When it is
            ``False`` the caller may skip computing confidences and pass any sequence of the right
            length (only ``len(confidences)`` is used).

    Single-request policies implement :meth:`start_round`, the incremental form: the caller offers
    ``c_1, c_2, ...`` one at a time and stops at the first refusal. That form lets the serial
    sampling loop stop as soon as the policy does (no Markov bias or logits processors for
    positions that will not be verified), and it makes every policy non-anticipating by
    construction: admitting position ``k`` can only depend on ``c_1..c_k``. :meth:`admit` runs
    the same decision over a whole list; :meth:`admit_batch` defaults to deciding every request
    on its own.
    """

    requires_confidences: bool = True

    def start_round(self, trace: list[float] | None = None) -> Callable[[float], bool]:
        """Starts one round's decision and returns ``offer``: ``offer(c_k)`` for ``k = 1, 2, ...``
        says whether position ``k`` is verified; after the first ``False`` it is not called again.

        ``trace``, when given, receives the policy's internal scores (see
        :meth:`PrefixScheduler.throughputs`)."""
        raise NotImplementedError

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        """Called after each verify forward of ``num_tokens`` tokens that took ``seconds``
        (a cost-model hook; the default ignores it)."""

    def admit(self, confidences: Sequence[float]) -> int:
        """Decides the verification length of one request.

        Args:
            confidences: ``c_1..c_n`` for the draft positions available this round (``n`` is
                ``gamma``, or fewer near the generation length budget).

        Returns:
            How many leading draft tokens to verify, in ``0..len(confidences)``.
        """
        return offer_until_refused(self.start_round(), _as_float_list(confidences), validate=_check_confidence)

    def admit_batch(self, confidences_per_request: Sequence[Sequence[float]]) -> list[int]:
        """Decides the verification lengths of ``R`` requests decoded together.

        Args:
            confidences_per_request: one confidence sequence per request (lengths may differ).

        Returns:
            One verification length per request, each in ``0..len(confidences_per_request[r])``.
        """
        return [self.admit(confidences) for confidences in confidences_per_request]


class FixedLengthPolicy(VerifyPolicy):
    """Verifies a fixed number of draft tokens, ``min(length, len(confidences))``.

    This is the DFlash behaviour (``length = gamma``) and does not look at the confidences.
    """

    requires_confidences = False

    def __init__(self, length: int) -> None:
        try:
            length = operator.index(length)
        except TypeError:
            raise ValueError(
                f"FixedLengthPolicy length must be an integer, got {length!r}; pass the number of "
                "draft tokens to verify each round (e.g. gamma)."
            ) from None
        if length < 0:
            raise ValueError(
                f"FixedLengthPolicy length must be >= 0, got {length}; pass the number of draft "
                "tokens to verify each round (0 disables speculation, gamma verifies all)."
            )
        self.length = length

    def start_round(self, trace: list[float] | None = None) -> Callable[[float], bool]:
        offered = 0

        def offer(confidence: float) -> bool:
            nonlocal offered
            offered += 1
            return offered <= self.length

        return offer

    def admit(self, confidences: Sequence[float]) -> int:
        return min(self.length, len(confidences))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self.length})"


class ThresholdPolicy(VerifyPolicy):
    """Static threshold on prefix survival: verifies the longest prefix with
    ``c_1 * ... * c_k >= threshold``.

    The scan stops at the first position that fails the threshold, so whether position ``k`` is
    admitted depends on ``c_1..c_k`` only (non-anticipating, like the prefix scheduler).
    """

    requires_confidences = True

    def __init__(self, threshold: float) -> None:
        threshold = float(threshold)
        if not 0.0 < threshold <= 1.0:
            raise ValueError(
                f"ThresholdPolicy threshold must be in (0, 1], got {threshold!r}; it is a "
                "probability that the whole prefix is accepted (e.g. 0.5)."
            )
        self.threshold = threshold

    def start_round(self, trace: list[float] | None = None) -> Callable[[float], bool]:
        survival = 1.0

        def offer(confidence: float) -> bool:
            nonlocal survival
            survival *= confidence
            if trace is not None:
                trace.append(survival)
            return survival >= self.threshold  # `>=` is False on NaN

        return offer

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self.threshold})"


class PerPositionThresholdPolicy(VerifyPolicy):
    """DeepSpec's ``--confidence-threshold`` rule: verifies draft positions up to the first one
    whose own confidence is below ``threshold``, i.e. the longest prefix with ``c_j >= threshold``
    for every ``j <= k``.

    Unlike :class:`ThresholdPolicy`, which thresholds the running product ``c_1 * ... * c_k``
    (the probability that the whole prefix survives), each position is judged on its own
    confidence: ``[0.7] * 5`` at ``threshold=0.5`` verifies 5 tokens here and 1 there. Use this one
    to reproduce DeepSpec's published threshold settings. Admitting position ``k`` depends on
    ``c_1..c_k`` only, so it is non-anticipating (lossless).
    """

    requires_confidences = True

    def __init__(self, threshold: float) -> None:
        threshold = float(threshold)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(
                f"PerPositionThresholdPolicy threshold must be in [0, 1], got {threshold!r}; it is the "
                "lowest confidence a draft position may have and still be verified (e.g. 0.5)."
            )
        self.threshold = threshold

    def start_round(self, trace: list[float] | None = None) -> Callable[[float], bool]:
        def offer(confidence: float) -> bool:
            if trace is not None:
                trace.append(confidence)
            return confidence >= self.threshold  # `>=` is False on NaN

        return offer

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self.threshold})"


class PrefixScheduler(VerifyPolicy):
    """The hardware-aware prefix scheduler (DSpark paper, Algorithm 1).

    Args:
        sps: the profiled step-rate table; ``sps[B - 1]`` is the number of target forward steps
            per second when one forward processes ``B`` tokens. It must be non-empty, finite,
            positive and non-increasing (:func:`profile_sps` returns such a table).
        live: treat ``sps`` as a prior that the verify times of the rounds correct (a
            :class:`~dspark_hf.cost_model.StepCostModel` built from it).
        cost_model: a (shared) live cost model instead of ``sps``; the default scheduler uses one
            per target and process.
        max_tokens: length of the table read from a cost model (default: its profiled length).

    With a live cost model the table is read once at the start of each round (in
    :meth:`start_round` / :meth:`admit_batch`), and only holds times of earlier rounds, so the
    decision still depends on nothing but past rounds and this round's confidences in order.

    For ``B`` beyond the table, the time per step is assumed to grow linearly with ``B`` from the
    last entry, i.e. ``SPS(B) = sps[-1] * len(sps) / B`` (a forward that is compute-bound at the
    end of the table stays compute-bound), see :meth:`step_rate`.

    Single request: with prefix survival ``s_k = c_1 * ... * c_k``, start at ``B = 1`` (the anchor
    token alone), ``E = 1``, ``best = SPS(1)``; for ``k = 1, 2, ...``: ``B += 1``, ``E += s_k``,
    ``Theta = SPS(B) * E``; stop at the first ``Theta <= best``, else ``best = Theta`` and
    ``keep = k``.

    ``R`` requests: all candidates ``(r, j)`` with ``a_{r,j} = s_{r,j} > 0`` are admitted one at a
    time in descending order of ``a`` (``B`` and ``E`` start at ``R``), stopping at the first
    non-improving ``Theta``.
    """

    requires_confidences = True

    def __init__(self, sps: Sequence[float] | None = None, *, live: bool = False,
                 cost_model: StepCostModel | None = None, max_tokens: int | None = None) -> None:
        if cost_model is None:
            if sps is None:
                raise ValueError("PrefixScheduler needs an SPS table (sps=...) or a cost_model.")
            table = self._validate_table(sps)
            if live:
                cost_model = StepCostModel([1.0 / rate for rate in table])
        elif sps is not None:
            raise ValueError("PrefixScheduler takes either an SPS table or a cost_model, not both.")
        self._static_sps = None if cost_model is not None else table
        self.cost_model = cost_model
        self.max_tokens = max_tokens or (cost_model.prior_length if cost_model is not None else len(table))

    @property
    def sps(self) -> tuple[float, ...]:
        """The step-rate table in use now: the static table, or the live cost model's current one."""
        if self.cost_model is None:
            return self._static_sps
        return self.cost_model.sps(self.max_tokens)

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        """With a live cost model: a verify forward of ``num_tokens`` tokens took ``seconds``."""
        if self.cost_model is not None:
            self.cost_model.observe(num_tokens, seconds)

    @classmethod
    def from_model(cls, model: torch.nn.Module, max_tokens: int, *, live: bool = False,
                   **profile_kwargs: Any) -> "PrefixScheduler":
        """Profiles ``model`` with :func:`profile_sps` (cached on disk) and builds a scheduler.

        ``max_tokens`` should cover the largest verify forward, ``R * (gamma + 1)`` tokens for
        ``R`` requests; beyond it the table is extrapolated (see :meth:`step_rate`). With
        ``live=True`` the table is a prior that observed verify times correct
        (:class:`~dspark_hf.cost_model.StepCostModel`).
        """
        return cls(profile_sps(model, max_tokens, **profile_kwargs), live=live)

    @staticmethod
    def _validate_table(sps: Sequence[float]) -> tuple[float, ...]:
        try:
            table = tuple(_as_float_list(sps))
        except (TypeError, ValueError):
            raise ValueError(
                f"SPS table must be a sequence of numbers, got {sps!r}; pass the table returned by "
                "profile_sps."
            ) from None
        if not table:
            raise ValueError(
                "SPS table is empty; pass the table returned by profile_sps (at least one entry, "
                "sps[B-1] = target steps per second for a forward of B tokens)."
            )
        for b, value in enumerate(table, start=1):
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(
                    f"SPS table entry for B={b} is {value!r}; every entry must be a finite number "
                    "> 0. Pass the table returned by profile_sps."
                )
        for b in range(1, len(table)):
            if table[b] > table[b - 1]:
                raise ValueError(
                    f"SPS table must be non-increasing in B, but SPS({b + 1}) = {table[b]!r} > "
                    f"SPS({b}) = {table[b - 1]!r}; pass the table returned by profile_sps or make it "
                    "non-increasing (e.g. fit the step times with monotone_step_times)."
                )
        return table

    def step_rate(self, num_tokens: int) -> float:
        """``SPS(B)`` for a forward of ``num_tokens = B >= 1`` tokens.

        Inside the table this is ``sps[B - 1]``. Beyond it, the time per step is assumed to grow
        linearly with ``B`` from the last entry: ``SPS(B) = sps[-1] * len(sps) / B``.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}.")
        return _rate_from_table(self.sps, num_tokens)

    # -- single request ------------------------------------------------------------------------

    def start_round(self, trace: list[float] | None = None) -> Callable[[float], bool]:
        table = self.sps
        tokens = 1  # B: the anchor token is always processed
        expected = 1.0  # E: the anchor/bonus token is always produced
        survival = 1.0
        best = table[0]
        if trace is not None:
            trace.append(best)

        def offer(confidence: float) -> bool:
            nonlocal tokens, expected, survival, best
            survival *= confidence
            tokens += 1
            expected += survival
            rate = _rate_from_table(table, tokens)
            theta = rate * expected
            if trace is not None:
                trace.append(theta)
            # Early stop: this is a correctness requirement, not a shortcut. c_{k+1} is computed
            # from the sampled token x_k, so looking at any Theta past the first drop would let
            # x_k decide whether x_k itself is verified, which biases the output distribution
            # (paper, Appendix A). Stopping here makes "k is admitted" a function of c_1..c_k
            # only, all known before x_k is drawn. (`not >` also stops on NaN.)
            if not theta > best:
                return False
            best = theta
            return True

        return offer

    def throughputs(self, confidences: Sequence[float]) -> list[float]:
        """The ``Theta`` values the single-request scheduler evaluates.

        Returns ``[Theta_0 = SPS(1), Theta_1, ...]`` up to and including the first non-improving
        one (or up to ``Theta_n`` when every position improves).
        """
        trace: list[float] = []
        offer_until_refused(self.start_round(trace), _as_float_list(confidences), validate=_check_confidence)
        return trace

    # -- many requests -------------------------------------------------------------------------

    def _admit_many(self, confidences_per_request: Sequence[Sequence[float]], trace: list[float] | None) -> list[int]:
        num_requests = len(confidences_per_request)
        lengths = [0] * num_requests
        if num_requests == 0:
            return lengths

        # Candidate space: every (r, j) with prefix survival a_{r,j} > 0, built in (r, j) order.
        candidates: list[tuple[float, int, int]] = []
        for r, confidences in enumerate(confidences_per_request):
            survival = 1.0
            for j, c in enumerate(_as_float_list(confidences), start=1):
                _check_confidence(c, j)
                survival *= c
                if survival <= 0.0:
                    break  # all later prefix products are 0 as well
                candidates.append((survival, r, j))
        # Descending by a; the sort is stable, so ties keep (r, j) ascending. Since
        # a_{r,j+1} = a_{r,j} * c_{r,j+1} <= a_{r,j} (also in floating point), position j of a
        # request always comes before position j + 1: admitted positions form a prefix.
        candidates.sort(key=lambda candidate: -candidate[0])

        table = self.sps  # one snapshot per round (a live cost model may change between rounds)
        tokens = num_requests  # B: one anchor token per request
        expected = float(num_requests)  # E: one bonus/corrected token per request
        best = num_requests * _rate_from_table(table, tokens)
        if trace is not None:
            trace.append(best)
        for survival, r, j in candidates:
            tokens += 1
            expected += survival
            theta = expected * _rate_from_table(table, tokens)
            if trace is not None:
                trace.append(theta)
            # Early stop (see start_round): everything visited so far has a >= a_{r,j} and comes
            # from other requests or from positions < j of request r, none of which depends on
            # the token x_{r,j}; positions j+1.. of request r come after (r, j). So admitting
            # (r, j) never depends on x_{r,j} itself. Looking past the first drop would break it.
            if not theta > best:
                break
            best = theta
            lengths[r] = j
        return lengths

    def admit_batch(self, confidences_per_request: Sequence[Sequence[float]]) -> list[int]:
        """Verification lengths for ``R`` requests decoded together (Algorithm 1)."""
        return self._admit_many(confidences_per_request, None)

    def batch_throughputs(self, confidences_per_request: Sequence[Sequence[float]]) -> list[float]:
        """The ``Theta`` values :meth:`admit_batch` evaluates, starting with ``R * SPS(R)`` and
        ending with the first non-improving one (or the last candidate)."""
        trace: list[float] = []
        self._admit_many(confidences_per_request, trace)
        return trace

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sps=<{len(self.sps)} entries, SPS(1)={self.sps[0]:.4g}>)"


# ---------------------------------------------------------------------------------------------
# Whether to draft at all
# ---------------------------------------------------------------------------------------------


class DraftingGate:
    """Decides, from past rounds only, whether drafting pays this round.

    The draft forward and serial loop are paid every round, even when the scheduler then
    verifies nothing. Where recent rounds show that drafting produces fewer tokens per second
    than plain target steps (chat at temperature 1 with a weak draft, or a CPU whose multi-token
    forward costs far more than a one-token one), the gate skips drafting and the round becomes a
    plain target step.

    The decision is a function of earlier rounds' outcomes and timings only, never of this
    round's draft tokens, so the output stays exactly the target's (which tokens are proposed,
    or whether any are, never changes what speculative decoding emits).

    Rates compare like with like: ``drafted`` rounds give (accepted + 1) tokens over their whole
    wall time (draft forward, serial loop, scheduler, verification); ``plain`` rounds give one
    token per sequence over their wall time. Both come from the last ``window`` rounds of each kind. A round
    that drafted but verified nothing also tells the time of a plain step (its wall time minus the
    drafting). While drafting is off, every ``probe_every``-th round drafts anyway, so a change of
    content (prose turning into code) is noticed.

    Args:
        window: rounds of each kind the rates are computed over.
        probe_every: while drafting does not pay, draft on one round in this many.
        min_rounds: drafted rounds observed before the gate may turn drafting off.
    """

    def __init__(self, window: int = 16, probe_every: int = 16, min_rounds: int = 4) -> None:
        if window < 1 or probe_every < 1 or min_rounds < 1:
            raise ValueError(
                f"DraftingGate needs window, probe_every and min_rounds >= 1, got {window}, {probe_every}, {min_rounds}."
            )
        self.window = window
        self.probe_every = probe_every
        self.min_rounds = min_rounds
        self._drafted: list[tuple[int, float]] = []  # (tokens produced, seconds)
        self._plain: list[tuple[int, float]] = []  # (tokens produced, seconds) of plain target steps
        self._skipped_in_a_row = 0

    def drafted_rate(self) -> float | None:
        """Tokens per second of recent drafted rounds (None before any)."""
        if not self._drafted:
            return None
        return sum(t for t, _ in self._drafted) / max(sum(s for _, s in self._drafted), 1e-12)

    def plain_rate(self) -> float | None:
        """Tokens per second of recent plain steps (None before any)."""
        if not self._plain:
            return None
        return sum(t for t, _ in self._plain) / max(sum(s for _, s in self._plain), 1e-12)

    def should_draft(self) -> bool:
        """Whether to run the draft this round."""
        drafted, plain = self.drafted_rate(), self.plain_rate()
        if len(self._drafted) < self.min_rounds or plain is None or drafted >= plain:
            self._skipped_in_a_row = 0
            return True
        if self._skipped_in_a_row + 1 >= self.probe_every:
            self._skipped_in_a_row = 0
            return True
        self._skipped_in_a_row += 1
        return False

    def record_drafted(self, tokens: int, seconds: float) -> None:
        """A round that ran the draft produced ``tokens`` (accepted + bonus) in ``seconds``."""
        self._drafted = (self._drafted + [(tokens, seconds)])[-self.window :]

    def record_plain(self, seconds: float, tokens: int = 1) -> None:
        """A plain target step (one token per running sequence: ``tokens``) took ``seconds``."""
        self._plain = (self._plain + [(tokens, seconds)])[-self.window :]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window}, probe_every={self.probe_every})"


# ---------------------------------------------------------------------------------------------
# Step-rate profiling
# ---------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$DSPARK_HF_CACHE`` if set, else ``~/.cache/dspark_hf``."""
    env = os.environ.get("DSPARK_HF_CACHE")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/dspark_hf").expanduser()


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
        # Packed oneDNN linears change the curve's shape, so they get their own profile.
        "cpu_fast_path": is_optimized_for_cpu(model),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        env["num_threads"] = torch.get_num_threads()
    return env


def _base_key(model: torch.nn.Module, context_length: int) -> str:
    # Everything that affects the step time except max_tokens; the config includes _name_or_path.
    payload = {
        "config": model.config.to_dict(),
        "environment": _environment(model),
        "context_length": context_length,
    }
    blob = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:24]


def sps_cache_key(model: torch.nn.Module, max_tokens: int, *, context_length: int = 256) -> str:
    """The on-disk cache key :func:`profile_sps` uses for ``model``.

    It hashes the model config (including ``_name_or_path``), the attention implementation, the
    device (type, and the GPU name on CUDA), the dtype, the torch and transformers versions,
    ``context_length`` and, on CPU, ``torch.get_num_threads()``; ``max_tokens`` is appended as
    ``-b<max_tokens>``.
    """
    return f"{_base_key(model, context_length)}-b{max_tokens}"


def _valid_table(values: Any, min_length: int) -> bool:
    if not isinstance(values, list) or len(values) < min_length or min_length < 1:
        return False
    # bool is an int subclass; an int beyond float range makes math.isfinite raise OverflowError.
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and _finite_positive(v) for v in values):
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
            logger.warning("Ignoring unreadable SPS cache file %s (%s); it will be re-profiled.", path,
                           type(error).__name__ if isinstance(error, RecursionError) else error)
            continue
        table = record.get("sps") if isinstance(record, dict) else None
        if _valid_table(table, max_tokens):
            return [float(v) for v in table[:max_tokens]], path
        logger.warning("Ignoring invalid SPS cache file %s.", path)
    return None


def load_sps_profile(model: torch.nn.Module, max_tokens: int, *, context_length: int = 256,
                     cache_dir: str | os.PathLike | None = None) -> dict | None:
    """The cached profile record :func:`profile_sps` wrote for ``model`` (raw median step times,
    fitted times, the table, the environment), or ``None`` if there is none covering ``max_tokens``."""
    directory = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "sps"
    if not directory.is_dir():
        return None
    found = _load_cached(directory, _base_key(model, context_length), max_tokens)
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
    """Times ``model(B new tokens)`` on top of a cached context, as a verify step runs."""

    def __init__(self, model: torch.nn.Module, context_length: int, max_tokens: int) -> None:
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
        self.context_ids = torch.randint(0, vocab, (1, context_length), generator=generator).to(self.device)
        self.new_ids = torch.randint(0, vocab, (1, max_tokens), generator=generator).to(self.device)
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
        """Seconds for one forward of ``num_tokens`` new tokens; the cache is rolled back after."""
        input_ids = self.new_ids[:, :num_tokens]
        self._sync()
        start = time.perf_counter()
        output = self._forward(input_ids, self.cache)
        self._sync()
        elapsed = time.perf_counter() - start
        del output
        self._rewind(num_tokens)
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
        context_length: tokens already in the KV cache when the step runs.
        warmup: untimed rounds over all ``B`` first.
        repeats: timed rounds over all ``B``.
        cache_dir: cache root; defaults to ``$DSPARK_HF_CACHE`` or ``~/.cache/dspark_hf``.
        use_cache: reuse a cached table when there is one.
        progress: show a tqdm progress bar.
        dense_up_to, stride: every ``B`` up to ``dense_up_to`` is measured, beyond it every
            ``stride``-th and ``max_tokens`` (large tables for batched decoding), with step times
            interpolated linearly in between; ``median_step_seconds`` in the cache file holds the
            interpolated values and ``measured_sizes`` the measured ``B``.

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
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"profile_sps: {name} must be an integer >= {minimum}, got {value!r}.")

    directory = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    directory = directory / "sps"
    base_key = _base_key(model, context_length)
    key = f"{base_key}-b{max_tokens}"

    if use_cache and directory.is_dir():
        found = _load_cached(directory, base_key, max_tokens)
        if found is not None:
            table, path = found
            logger.info("Using the cached SPS table %s.", path)
            return table

    environment = _environment(model)
    logger.info(
        "Profiling the target step rate SPS(B) for B = 1..%d new tokens on a %d-token cached context "
        "(%s, %s, %d warm-up + %d timed rounds); the table is cached under %s.",
        max_tokens,
        context_length,
        environment["device_type"] if environment["device_name"] is None else environment["device_name"],
        environment["dtype"],
        warmup,
        repeats,
        directory,
    )

    # Every B up to `dense_up_to` (where a CPU's kernels switch paths and the curve is jagged),
    # then every `stride`-th B and the last one; step time is interpolated linearly in between.
    sizes = list(range(1, min(max_tokens, dense_up_to) + 1))
    sizes += [b for b in range(dense_up_to + stride, max_tokens, stride)] + ([max_tokens] if max_tokens > dense_up_to else [])
    samples: dict[int, list[float]] = {b: [] for b in sizes}
    order_rng = random.Random(0)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            timer = _VerifyStepTimer(model, context_length, max_tokens)
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


# ---------------------------------------------------------------------------------------------
# The live cost model the default scheduler uses: one per target and process
# ---------------------------------------------------------------------------------------------

DEFAULT_PROFILE_TOKENS = 16
_shared_cost_models: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, StepCostModel]]" = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def _longest_cached_profile(directory: Path, base_key: str) -> tuple[list[float], Path] | None:
    lengths = []
    for path in directory.glob(f"{base_key}-b*.json"):
        try:
            lengths.append(int(path.stem.rsplit("-b", 1)[1]))
        except (IndexError, ValueError):
            continue
    for length in sorted(set(lengths), reverse=True):
        found = _load_cached(directory, base_key, length)
        if found is not None:
            return found
    return None


def _rewrite_profile_on_drift(path: Path, record: dict) -> Callable[[StepCostModel], None]:
    def on_drift(cost_model: StepCostModel) -> None:
        length = cost_model.prior_length
        logger.warning(
            "The target's live step times differ from its profiled SPS table by up to x%.2f after %d rounds "
            "(a profile taken under load, at another context length or on another machine state); the "
            "scheduler uses the live times, and the cache file %s is updated with them.",
            cost_model.drift(), cost_model.num_observations, path,
        )
        updated = dict(record)
        updated["fitted_step_seconds"] = cost_model.step_seconds(length)
        updated["sps"] = list(cost_model.sps(length))
        updated["live_corrected"] = {"observations": cost_model.num_observations, "updated_unix": time.time()}
        _write_record(path, updated)

    return on_drift


def shared_cost_model(
    model: torch.nn.Module,
    *,
    profile_tokens: int = DEFAULT_PROFILE_TOKENS,
    context_length: int = 256,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> StepCostModel:
    """The live cost model of ``model`` in this process (what the default scheduler uses).

    Built once per target, process and environment (see :func:`sps_cache_key`), from the longest
    SPS profile cached on disk (``dspark-hf profile`` writes one ahead of time), or else from a
    fresh profile of ``profile_tokens`` tokens (a few seconds). Larger verify forwards (batched
    decoding) are not profiled again: the table is extrapolated beyond its end and the observed
    verify times correct it. When the live times drift far from the profile, a warning is logged
    and the cache file is rewritten with the live estimate.
    """
    directory = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "sps"
    base_key = _base_key(model, context_length)
    with _shared_lock:
        per_model = _shared_cost_models.setdefault(model, {})
        cost_model = per_model.get(base_key)
        if cost_model is not None:
            return cost_model
        found = _longest_cached_profile(directory, base_key) if directory.is_dir() else None
        if found is None:
            sps = profile_sps(model, profile_tokens, context_length=context_length, cache_dir=cache_dir,
                              use_cache=False, progress=progress)
            path = directory / f"{base_key}-b{profile_tokens}.json"
        else:
            sps, path = found
            logger.info("Using the cached SPS table %s as the cost model's prior.", path)
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError, RecursionError):
            record = {"sps": sps}
        cost_model = StepCostModel([1.0 / rate for rate in sps], on_drift=_rewrite_profile_on_drift(path, record))
        per_model[base_key] = cost_model
        return cost_model
