"""dspark_hf: DSpark speculative decoding for Hugging Face transformers.

After ``import dspark_hf``, ``target.generate(**inputs, assistant_model=draft)`` with a
:class:`DSparkDraftModel` runs DSpark decoding (greedy or sampling, output unchanged).
"""

from .model.auto_classes import register_auto_classes
from .decoding.candidate_generator import DSparkCandidateGenerator
from .model.checkpoint_formats import checkpoint_format
from .model.configuration_dspark import DSparkConfig, is_dspark_config
from .scheduling.cost_model import StepCostModel
from .kernels.cpu_fast_path import optimize_for_cpu
# Hub tooling re-exported for users: the package facade, not the decoding path (docs/architecture.md)
from .hub import export, push_to_hub, render_model_card
from .decoding.integration import install_dspark_dispatch, is_dspark_dispatch_installed
from .model.modeling_dspark import DSparkDraftModel, default_target_layer_ids
from .decoding.sampling import SerialSample, serial_sample
from .scheduling.drafting_gate import DraftingGate
from .scheduling.policies import FixedLengthPolicy, PerPositionThresholdPolicy, PrefixScheduler, ThresholdPolicy, VerifyPolicy
from .decoding.rounds import DSparkGenerationStats, RoundStats
from .scheduling.shared_cost import shared_cost_model
from .scheduling.step_rates import profile_sps

__version__ = "0.1.0"

install_dspark_dispatch()
register_auto_classes()

__all__ = [
    "DraftingGate",
    "DSparkCandidateGenerator",
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkGenerationStats",
    "FixedLengthPolicy",
    "PerPositionThresholdPolicy",
    "PrefixScheduler",
    "RoundStats",
    "SerialSample",
    "StepCostModel",
    "ThresholdPolicy",
    "checkpoint_format",
    "default_target_layer_ids",
    "export",
    "install_dspark_dispatch",
    "is_dspark_config",
    "is_dspark_dispatch_installed",
    "optimize_for_cpu",
    "profile_sps",
    "push_to_hub",
    "register_auto_classes",
    "render_model_card",
    "serial_sample",
    "shared_cost_model",
    "VerifyPolicy",
]
