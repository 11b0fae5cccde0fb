"""The draft model's run-time state: this thread's latest statistics and the deprecated attributes.

:class:`DraftRuntimeSettings` is mixed into :class:`~dspark_hf.modeling_dspark.DSparkDraftModel`.
It sits below the model and imports nothing from the scheduling stack (settings, policies, step
rates, cost model, rounds): the model module stays a model, and the generation loops, which do
import the scheduling stack, record their statistics here with :func:`record_generation_stats`.

Nothing here holds per-call state on the draft: statistics are kept per thread, and the deprecated
attributes read and write the draft's ``generation_config``, where :mod:`dspark_hf.decoding.settings`
resolves every call's settings.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

__all__ = ["DraftRuntimeSettings", "GATE_FIELD", "POLICY_FIELD", "record_generation_stats"]

# The draft generation_config fields DSpark adds (read by dspark_hf.decoding.settings).
POLICY_FIELD = "dspark_verify_policy"
GATE_FIELD = "dspark_adaptive_drafting"

_LAST_STATS = threading.local()  # per thread: {draft: stats of its latest call in this thread}


def record_generation_stats(draft: Any, stats: Any) -> None:
    """Makes ``stats`` what ``draft.last_generation_stats`` returns in the calling thread."""
    per_draft = getattr(_LAST_STATS, "by_draft", None)
    if per_draft is None:
        per_draft = _LAST_STATS.by_draft = weakref.WeakKeyDictionary()
    per_draft[draft] = stats


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"draft.{old} is deprecated and will be removed in the next release; use {new} instead.",
                  FutureWarning, stacklevel=3)


class DraftRuntimeSettings:
    """The draft model's view of run-time settings and statistics (mixed into ``DSparkDraftModel``).

    ``last_generation_stats`` is the statistics of the latest ``generate`` call made with this
    draft from the calling thread. The old attributes ``verify_policy``, ``adaptive_drafting`` and
    ``generation_stats`` still work for one release, with a ``FutureWarning``: the first two read
    and write ``generation_config.dspark_verify_policy`` / ``dspark_adaptive_drafting``.
    """

    @property
    def last_generation_stats(self):
        """:class:`~dspark_hf.decoding.rounds.DSparkGenerationStats` of this thread's latest
        ``generate`` call with this draft (``None`` before the first)."""
        per_draft = getattr(_LAST_STATS, "by_draft", None)
        return None if per_draft is None else per_draft.get(self)

    @property
    def generation_stats(self):
        _deprecated("generation_stats", "draft.last_generation_stats")
        return self.last_generation_stats

    @generation_stats.setter
    def generation_stats(self, stats) -> None:
        _deprecated("generation_stats", "draft.last_generation_stats")
        record_generation_stats(self, stats)

    @property
    def verify_policy(self):
        _deprecated("verify_policy", f"draft.generation_config.{POLICY_FIELD} or generate(..., {POLICY_FIELD}=...)")
        return getattr(self.generation_config, POLICY_FIELD, None)

    @verify_policy.setter
    def verify_policy(self, policy) -> None:
        _deprecated("verify_policy", f"draft.generation_config.{POLICY_FIELD} or generate(..., {POLICY_FIELD}=...)")
        setattr(self.generation_config, POLICY_FIELD, policy)

    @property
    def adaptive_drafting(self):
        _deprecated("adaptive_drafting", f"draft.generation_config.{GATE_FIELD} or generate(..., {GATE_FIELD}=...)")
        return getattr(self.generation_config, GATE_FIELD, None)

    @adaptive_drafting.setter
    def adaptive_drafting(self, choice) -> None:
        _deprecated("adaptive_drafting", f"draft.generation_config.{GATE_FIELD} or generate(..., {GATE_FIELD}=...)")
        setattr(self.generation_config, GATE_FIELD, choice)
