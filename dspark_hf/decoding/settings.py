"""Run-time settings of DSpark generation, read where transformers users set speculation.

A transformers user tunes assisted generation on the assistant's ``generation_config`` or per call
as ``generate()`` keyword arguments. DSpark reads its settings from the same two places, once per
call (:func:`resolve_settings`); the call wins over the draft's ``generation_config``, which wins
over DSpark's defaults. Nothing is read from, or written to, attributes of the draft model, so two
threads generating with one draft do not share any per-call state.

DSpark's own fields (any ``GenerationConfig`` accepts them as extra attributes):

* ``dspark_verify_policy``: ``"scheduler"``, ``"fixed"``, ``"threshold"``,
  ``"per_position_threshold"``, or a :class:`~dspark_hf.scheduling.policies.VerifyPolicy` instance
  (a policy of your own). ``None``: the default (see :func:`resolve_verify_policy`).
* ``dspark_adaptive_drafting``: ``None`` (default), ``True``/``False``, or a
  :class:`~dspark_hf.scheduling.drafting_gate.DraftingGate` (see :func:`resolve_drafting_gate`).

transformers' own assisted-generation fields keep their documented meaning:

* ``num_assistant_tokens``: the most draft tokens verified per round (0 to the block size); alone
  it selects a fixed length, with another policy it caps that policy.
* ``assistant_confidence_threshold``: stop at the first draft token whose confidence is below it
  (DSpark's confidence head gives the confidence); alone it selects ``"per_position_threshold"``,
  and it is the threshold of both threshold policies.
* ``num_assistant_tokens_schedule``: ``"constant"`` keeps the length; ``"heuristic"`` and
  ``"heuristic_transient"`` ask for a length that adapts as generation goes, which on a draft with
  a confidence head is DSpark's scheduler.
* ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``: context lookup (see
  :func:`resolve_context_lookup`).

transformers fills every unset field of the call's config with its global defaults
(``num_assistant_tokens=20``, ``assistant_confidence_threshold=0.4``, ...). Those defaults must not
replace DSpark's scheduler, so only values set explicitly count: on the draft's
``generation_config`` (where transformers' fields start as ``None``), or on the call (a
``generate()`` keyword, the ``generation_config`` passed to it, or the target's own
``generation_config``), which :func:`mark_call_settings` records while transformers prepares
the call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig, PreTrainedModel
from transformers.utils import logging

from .context_lookup import ContextLookup
# The draft's run-time state moved below the model; DraftRuntimeSettings and record_generation_stats
# are still importable from here.
from ..model.draft_runtime import GATE_FIELD, POLICY_FIELD, DraftRuntimeSettings, record_generation_stats
from ..scheduling.drafting_gate import DraftingGate, continue_earlier_gate
from ..scheduling.policies import FixedLengthPolicy, PerPositionThresholdPolicy, PrefixScheduler, ThresholdPolicy, VerifyPolicy
from ..scheduling.shared_cost import cost_model_covering, shared_cost_model

logger = logging.get_logger(__name__)

DSPARK_FIELDS = (POLICY_FIELD, GATE_FIELD)
POLICY_NAMES = ("scheduler", "fixed", "threshold", "per_position_threshold")
# transformers' assisted-generation fields DSpark reads (their defaults must not count as set).
ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                    "prompt_lookup_num_tokens", "max_matching_ngram_size")
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
# Names of the fields set explicitly on a call, stored on the call's (per-call) GenerationConfig.
_EXPLICIT_MARK = "_dspark_explicit_fields"

DEFAULT_LOOKUP_TOKENS = 10
DEFAULT_LOOKUP_NGRAM = 3


@dataclass
class DSparkSettings:
    """What one generate call runs with (fresh objects per call, except a user's policy instance).

    Attributes:
        policy: decides how many draft tokens the target verifies each round.
        gate: the drafting gate (its history is this call's), or None when drafting is always on.
        lookup: context lookup (batch size 1), or None when off.
        max_draft_tokens: the most draft tokens one round verifies (the block size unless
            ``num_assistant_tokens`` caps it).
    """

    policy: VerifyPolicy
    gate: DraftingGate | None
    lookup: ContextLookup | None
    max_draft_tokens: int


# ------------------------------------------------------------------------ where values come from
def mark_call_settings(config: GenerationConfig, dspark_kwargs: dict[str, Any], call_kwargs: dict[str, Any],
                       passed_config: GenerationConfig | None, model_config: GenerationConfig | None) -> None:
    """Records on the call's prepared ``config`` what this call set explicitly.

    ``dspark_kwargs`` (DSpark fields passed to ``generate()``) are set on ``config``. transformers'
    assisted-generation fields count as set when passed to ``generate()`` or not ``None`` on the
    ``generation_config`` passed to it or on the target's own ``generation_config``; the names go
    to a private attribute that :func:`resolve_settings` reads, so defaults filled in by
    transformers are told apart from a user's choice.
    """
    unknown = sorted(name for name in dspark_kwargs if name not in DSPARK_FIELDS)
    if unknown:
        raise ValueError(f"Unknown DSpark setting(s) {unknown}; the DSpark generate() settings are {list(DSPARK_FIELDS)}.")
    explicit = set(dspark_kwargs)
    for name in ASSISTANT_FIELDS:
        if call_kwargs.get(name) is not None or any(
                getattr(source, name, None) is not None for source in (passed_config, model_config)):
            explicit.add(name)
    for name, value in dspark_kwargs.items():
        setattr(config, name, value)
    setattr(config, _EXPLICIT_MARK, tuple(sorted(explicit)))


def refuse_lossy_settings(config: GenerationConfig, draft: PreTrainedModel) -> None:
    """Raises ``ValueError`` for transformers' lossy verification, ``assistant_ensemble_weight``
    (on the call or the draft's ``generation_config``): it accepts draft tokens against a mix of
    the target's and the draft's distributions, so the output is no longer the target's."""
    for source, where in ((config, "the generate() call"), (getattr(draft, "generation_config", None),
                                                            "the draft's generation_config")):
        weight = getattr(source, "assistant_ensemble_weight", None)
        if weight is not None:
            raise ValueError(
                f"assistant_ensemble_weight={weight!r} (from {where}) selects transformers' ensemble verification, "
                "which mixes the draft's distribution into the target's and changes the output; DSpark decoding is "
                "lossless (greedy output is the target's, sampled output follows its distribution) and does not "
                "support it. Drop assistant_ensemble_weight (None is the standard, lossless verification)."
            )


def dspark_kwargs_of_call(config: GenerationConfig) -> list[str]:
    """The DSpark fields this call passed as ``generate()`` keywords (to refuse them without a DSpark draft)."""
    return [name for name in getattr(config, _EXPLICIT_MARK, ()) if name in DSPARK_FIELDS]


def _explicit_on_call(config: GenerationConfig, name: str) -> bool:
    marked = getattr(config, _EXPLICIT_MARK, None)
    if marked is not None:
        return name in marked
    # A config that did not pass through generate(): only a value other than transformers' default counts.
    value = getattr(config, name, None)
    return value is not None and value != GenerationConfig._get_default_generation_params().get(name)


def _setting(name: str, draft: PreTrainedModel, config: GenerationConfig | None) -> tuple[Any, str]:
    """``(value, where it was set)`` of one field: the call first, then the draft's generation_config."""
    if config is not None:
        if name in DSPARK_FIELDS:
            value = getattr(config, name, None)
            if value is not None:
                return value, "the generate() call"
        elif _explicit_on_call(config, name):
            return getattr(config, name), "the generate() call"
    value = getattr(getattr(draft, "generation_config", None), name, None)
    return value, "the draft's generation_config"


# ------------------------------------------------------------------------------------- resolution
def resolve_settings(draft: PreTrainedModel, target: PreTrainedModel, generation_config: GenerationConfig | None,
                     num_rows: int = 1) -> DSparkSettings:
    """The settings of one call with ``num_rows`` sequences (see the module docstring for the fields)."""
    policy = resolve_verify_policy(draft, target, num_rows, generation_config)
    return DSparkSettings(
        policy=policy,
        gate=resolve_drafting_gate(draft, policy, generation_config, num_rows),
        lookup=resolve_context_lookup(draft, generation_config, policy),
        max_draft_tokens=_draft_token_cap(draft, generation_config),
    )


def _draft_token_cap(draft: PreTrainedModel, config: GenerationConfig | None) -> int:
    """``num_assistant_tokens`` when set (checked against the block size), else the block size."""
    block_size = draft.config.block_size
    value, where = _setting("num_assistant_tokens", draft, config)
    if value is None:
        return block_size
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= block_size:
        raise ValueError(
            f"num_assistant_tokens={value!r} (from {where}) must be an integer from 0 to {block_size}, this draft's "
            f"block size (one draft forward proposes at most {block_size} tokens; 0 turns drafting off). Pass "
            f"num_assistant_tokens={min(block_size, 4)} for example, or leave it unset for DSpark's scheduler."
        )
    return value


def _threshold(draft: PreTrainedModel, config: GenerationConfig | None) -> tuple[float | None, str]:
    value, where = _setting("assistant_confidence_threshold", draft, config)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0.0 <= float(value) <= 1.0):
        raise ValueError(
            f"assistant_confidence_threshold={value!r} (from {where}) must be a number in [0, 1]: the lowest "
            "confidence a draft token may have and still be verified (e.g. 0.5)."
        )
    return (None if value is None else float(value)), where


def _schedule_adapts(draft: PreTrainedModel, config: GenerationConfig | None) -> bool:
    """Whether ``num_assistant_tokens_schedule`` asks for an adaptive length ("heuristic*")."""
    value, where = _setting("num_assistant_tokens_schedule", draft, config)
    if value is not None and value not in SCHEDULES:
        raise ValueError(
            f"num_assistant_tokens_schedule={value!r} (from {where}) is not one of {list(SCHEDULES)}."
        )
    return value in ("heuristic", "heuristic_transient")


def _policy_choice(draft: PreTrainedModel, config: GenerationConfig | None) -> tuple[Any, str]:
    """The chosen policy (a name, an instance, or None for the default) and the setting that chose
    it, as error messages name it (e.g. "assistant_confidence_threshold=0.6 (from the generate() call)")."""
    choice, where = _setting(POLICY_FIELD, draft, config)
    threshold, threshold_where = _threshold(draft, config)
    adapts = _schedule_adapts(draft, config)
    length, length_where = _setting("num_assistant_tokens", draft, config)
    if choice is not None:
        if threshold is not None and choice not in ("threshold", "per_position_threshold"):
            logger.warning_once(
                f"assistant_confidence_threshold={threshold} (from {threshold_where}) is not used: {POLICY_FIELD}="
                f"{choice!r} (from {where}) decides the verify lengths. Drop one of the two settings."
            )
        return choice, f"{POLICY_FIELD}={choice!r} (from {where})"
    if threshold is not None:
        return "per_position_threshold", f"assistant_confidence_threshold={threshold} (from {threshold_where})"
    if adapts and draft.confidence_head is not None:
        return "scheduler", "num_assistant_tokens_schedule='heuristic'"
    if adapts:
        logger.warning_once(
            "num_assistant_tokens_schedule='heuristic' has no effect with a DFlash draft (no confidence head): "
            "it verifies a fixed number of tokens (num_assistant_tokens, else its block size). Drop the setting "
            "to silence this message."
        )
    if length is not None:
        return "fixed", f"num_assistant_tokens={length} (from {length_where})"
    return None, "DSpark's default"


def resolve_verify_policy(draft: PreTrainedModel, target: PreTrainedModel, num_rows: int = 1,
                          generation_config: GenerationConfig | None = None) -> VerifyPolicy:
    """The call's verify policy.

    ``dspark_verify_policy`` when set; else ``assistant_confidence_threshold`` (per-position
    threshold); else an adaptive ``num_assistant_tokens_schedule`` (the scheduler); else
    ``num_assistant_tokens`` (a fixed length); else the default: with a confidence head, a scheduler
    on the target's live cost model (:func:`~dspark_hf.scheduling.shared_cost.shared_cost_model`: a profiled
    prior, one per target and process, corrected by every round's verify time) for up to
    ``gamma + 1`` tokens, or for a batch ``num_rows x (1 + the longest proposal)`` on the cost model
    of batches of ``num_rows`` rows, profiled with that many rows
    (:func:`~dspark_hf.scheduling.shared_cost.cost_model_covering`); without one
    (DFlash), the full block.
    """
    choice, source = _policy_choice(draft, generation_config)
    has_confidence = draft.confidence_head is not None
    block_size = draft.config.block_size
    if choice is None:
        choice = "scheduler" if has_confidence else "fixed"
    if isinstance(choice, str) and choice in POLICY_NAMES:
        if choice != "fixed" and not has_confidence:
            raise ValueError(
                f"{source} needs confidences, but this draft has no confidence head (a DFlash draft). Use "
                f"num_assistant_tokens=n or {POLICY_FIELD}='fixed', or leave both unset (the full block)."
            )
        if choice == "scheduler":
            if num_rows == 1:
                return PrefixScheduler(cost_model=shared_cost_model(target), max_tokens=block_size + 1)
            # A batched forward is rows x (1 + the longest proposal, a draft block or a lookup copy).
            lookup_tokens, _ = _setting("prompt_lookup_num_tokens", draft, generation_config)
            if not isinstance(lookup_tokens, int) or isinstance(lookup_tokens, bool) or lookup_tokens < 0:
                lookup_tokens = DEFAULT_LOOKUP_TOKENS  # an invalid value is refused with lookup's own message
            widest = num_rows * (1 + max(block_size, lookup_tokens))
            return PrefixScheduler(cost_model=cost_model_covering(target, widest, rows=num_rows), max_tokens=widest)
        if choice == "fixed":
            return FixedLengthPolicy(_draft_token_cap(draft, generation_config))
        threshold, _ = _threshold(draft, generation_config)
        if threshold is None:
            raise ValueError(
                f"{source} needs assistant_confidence_threshold; pass it to generate() or set it on the draft's "
                "generation_config (e.g. assistant_confidence_threshold=0.5)."
            )
        try:
            return ThresholdPolicy(threshold) if choice == "threshold" else PerPositionThresholdPolicy(threshold)
        except ValueError as err:
            raise ValueError(f"assistant_confidence_threshold={threshold} does not suit {source}: {err}") from None
    if not isinstance(choice, VerifyPolicy):
        raise ValueError(_not_a_policy_message(choice, source))
    if choice.requires_confidences and not has_confidence:
        raise ValueError(
            f"{source} needs confidences, but this draft has no confidence head (a DFlash draft). Use "
            f"{POLICY_FIELD}='fixed' (or FixedLengthPolicy(n)), or leave it unset."
        )
    return choice


def _not_a_policy_message(policy: Any, source: str) -> str:
    if isinstance(policy, type):
        hint = f" That is the class {policy.__name__}; set an instance, e.g. {policy.__name__}(...)."
    elif isinstance(policy, int) and not isinstance(policy, bool) and policy >= 0:
        hint = f" For {policy} draft tokens every round, pass num_assistant_tokens={policy} or FixedLengthPolicy({policy})."
    else:
        hint = ""
    return (
        f"{source}: {POLICY_FIELD} must be None (the default), one of {list(POLICY_NAMES)}, or a VerifyPolicy "
        f"instance from dspark_hf (FixedLengthPolicy(n), ThresholdPolicy(t), PrefixScheduler(sps) or a VerifyPolicy "
        f"subclass), got {policy!r} ({type(policy).__name__}).{hint}"
    )


def resolve_drafting_gate(draft: PreTrainedModel, policy: VerifyPolicy,
                          generation_config: GenerationConfig | None = None, num_rows: int = 1) -> DraftingGate | None:
    """A fresh gate for this call from ``dspark_adaptive_drafting``: None (default) turns it on for
    the confidence-driven policies (scheduler, thresholds) and off for fixed lengths; True/False
    force it; a :class:`DraftingGate` instance is copied (its settings, fresh history). The gate
    made here for a batch (``num_rows > 1``) is :meth:`DraftingGate.for_batches`; a default gate
    continues from the last one made for this draft with as many rows and the same sampling
    (:func:`~dspark_hf.scheduling.drafting_gate.continue_earlier_gate`), so a second call does not
    pay again for learning that drafting loses, and a new batch size starts where the nearest smaller one
    found drafting lost."""
    choice, where = _setting(GATE_FIELD, draft, generation_config)
    if isinstance(choice, DraftingGate):
        return copy.deepcopy(choice)
    if choice is None:
        choice = bool(getattr(policy, "requires_confidences", False))
    elif not isinstance(choice, bool):
        raise ValueError(
            f"{GATE_FIELD} (from {where}) must be None (the default), True, False or a DraftingGate, got {choice!r}."
        )
    if not choice:
        return None
    gate = DraftingGate.for_batches() if num_rows > 1 else DraftingGate()
    sampling = bool(getattr(generation_config, "do_sample", False))
    return continue_earlier_gate(draft, num_rows, sampling, gate)


def resolve_context_lookup(draft: PreTrainedModel, generation_config: GenerationConfig | None,
                           policy: VerifyPolicy) -> ContextLookup | None:
    """The call's context lookup (see :mod:`dspark_hf.decoding.context_lookup`), from transformers' own
    prompt-lookup settings: ``prompt_lookup_num_tokens`` (the longest proposal; 0 turns lookup off)
    and ``max_matching_ngram_size``, read from the call, else the draft's ``generation_config``.
    When neither sets it, lookup is on (10 tokens, 3-grams) with the default scheduler, whose live
    cost model values both sources, and off with fixed-length and threshold policies."""
    num_tokens, where = _setting("prompt_lookup_num_tokens", draft, generation_config)
    ngram, ngram_where = _setting("max_matching_ngram_size", draft, generation_config)
    if ngram is not None and (isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1):
        raise ValueError(
            f"max_matching_ngram_size={ngram!r} (from {ngram_where}) must be an integer >= 1: the longest n-gram "
            f"context lookup matches (default {DEFAULT_LOOKUP_NGRAM})."
        )
    if num_tokens is None:
        if not isinstance(policy, PrefixScheduler) or policy.cost_model is None:
            return None
        num_tokens = DEFAULT_LOOKUP_TOKENS
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(
            f"prompt_lookup_num_tokens={num_tokens!r} (from {where}) must be an integer >= 0 (0 turns context "
            "lookup off)."
        )
    if num_tokens == 0:
        return None
    return ContextLookup(max_tokens=num_tokens, max_ngram=DEFAULT_LOOKUP_NGRAM if ngram is None else ngram)


__all__ = ["DSPARK_FIELDS", "DSparkSettings", "DraftRuntimeSettings", "POLICY_NAMES", "mark_call_settings",
           "record_generation_stats", "refuse_lossy_settings", "resolve_context_lookup", "resolve_drafting_gate", "resolve_settings",
           "resolve_verify_policy"]
