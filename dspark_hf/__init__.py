"""dspark_hf: DSpark speculative decoding for Hugging Face transformers.

After ``import dspark_hf``, ``target.generate(**inputs, assistant_model=draft)`` with a
:class:`DSparkDraftModel` runs DSpark decoding (greedy or sampling, output unchanged).

``dspark_hf.optimize_for_cpu`` is the CPU engine's (the ``dspark_cpu`` package, installed from ``cpu_engine/``):
it is looked up on first use and raises an ``ImportError`` saying how to install the engine where it is missing.
"""

from .model.auto_classes import register_auto_classes
from .decoding.candidate_generator import DSparkCandidateGenerator
from .model.checkpoint_formats import checkpoint_format
from .model.configuration_dspark import DSparkConfig, is_dspark_config
from .scheduling.cost_model import StepCostModel
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

# Names that live in the CPU engine (dspark_cpu) and keep answering here while it is installed.
_ENGINE_NAMES = ("optimize_for_cpu",)


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        from .cpu_engine import load_engine  # CpuEngineNotInstalled (an ImportError) says how to install it

        return getattr(load_engine(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "profile_sps",
    "push_to_hub",
    "register_auto_classes",
    "render_model_card",
    "serial_sample",
    "shared_cost_model",
    "VerifyPolicy",
]
