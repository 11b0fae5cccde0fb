"""Former home of the verification policies, the drafting gate and the step-rate profiler.

Kept so that ``from dspark_hf.scheduler import ...`` goes on working; new code imports from where
each piece lives now:

* :mod:`dspark_hf.scheduling.policies`: ``VerifyPolicy``, ``PrefixScheduler``, ``FixedLengthPolicy``,
  ``ThresholdPolicy``, ``PerPositionThresholdPolicy``;
* :mod:`dspark_hf.scheduling.drafting_gate`: ``DraftingGate``;
* :mod:`dspark_hf.scheduling.step_rates`: ``profile_sps``, ``load_sps_profile``, ``sps_cache_key``;
* :mod:`dspark_hf.scheduling.shared_cost`: ``shared_cost_model``;
* :mod:`dspark_hf.scheduling.cost_model`: ``StepCostModel``, ``monotone_step_times``;
* :mod:`dspark_hf.cache_dir`: ``default_cache_dir``.
"""

from .cache_dir import default_cache_dir
from .scheduling.cost_model import StepCostModel, monotone_step_times
from .scheduling.drafting_gate import DraftingGate
from .scheduling.policies import FixedLengthPolicy, PerPositionThresholdPolicy, PrefixScheduler, ThresholdPolicy, VerifyPolicy
from .scheduling.shared_cost import shared_cost_model
from .scheduling.step_rates import load_sps_profile, profile_sps, sps_cache_key

__all__ = [
    "default_cache_dir",
    "DraftingGate",
    "FixedLengthPolicy",
    "load_sps_profile",
    "monotone_step_times",
    "PerPositionThresholdPolicy",
    "PrefixScheduler",
    "profile_sps",
    "shared_cost_model",
    "sps_cache_key",
    "StepCostModel",
    "ThresholdPolicy",
    "VerifyPolicy",
]
