"""Routes ``generate(..., assistant_model=<DSpark draft>)`` to :class:`DSparkCandidateGenerator`.

transformers has no registration hook for candidate generators: ``GenerationMixin.
_get_candidate_generator`` is a fixed if/elif chain. :func:`install_dspark_dispatch` wraps that one
method, once, and the wrapper only acts when the assistant's config is a DSpark/DFlash draft config
(recognised by content, since Hub remote code makes other class objects). Every other call goes to
the original method unchanged.
"""

from __future__ import annotations

import functools
import inspect

import transformers
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerationMixin

from .configuration_dspark import is_dspark_config

_EXPECTED_PARAMETERS = (
    "generation_config",
    "input_ids",
    "inputs_tensor",
    "logits_processor",
    "model_kwargs",
    "assistant_model",
)
_MARKER = "_dspark_dispatch"


def _check_transformers_api() -> None:
    """Fails loudly if the private API the dispatch relies on has changed."""
    problems = []
    original = getattr(GenerationMixin, "_get_candidate_generator", None)
    if original is None:
        problems.append("GenerationMixin._get_candidate_generator is gone")
    else:
        params = inspect.signature(original).parameters
        missing = [p for p in _EXPECTED_PARAMETERS if p not in params]
        if missing:
            problems.append(f"_get_candidate_generator lacks parameters {missing}")
    if not hasattr(CandidateGenerator, "requires_model_outputs"):
        problems.append("CandidateGenerator.requires_model_outputs is missing")
    if not hasattr(GenerationMixin, "_assisted_decoding"):
        problems.append("GenerationMixin._assisted_decoding is gone")
    if problems:
        raise RuntimeError(
            f"dspark_hf cannot hook into transformers {transformers.__version__}: {'; '.join(problems)}. "
            "Install a supported version: pip install 'transformers>=5.24,<6'."
        )


def install_dspark_dispatch() -> None:
    """Installs the DSpark dispatch into transformers' generation (idempotent; run on import)."""
    current = GenerationMixin._get_candidate_generator
    if getattr(current, _MARKER, False):
        return
    _check_transformers_api()
    original = current

    @functools.wraps(original)
    def _get_candidate_generator(
        self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model=None, **kwargs
    ):
        if assistant_model is not None and is_dspark_config(assistant_model.config):
            from .candidate_generator import DSparkCandidateGenerator

            return DSparkCandidateGenerator(
                assistant_model,
                self,
                generation_config=generation_config,
                logits_processor=logits_processor,
                batch_size=input_ids.shape[0],
            )
        return original(
            self,
            generation_config=generation_config,
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            model_kwargs=model_kwargs,
            assistant_model=assistant_model,
            **kwargs,
        )

    setattr(_get_candidate_generator, _MARKER, True)
    _get_candidate_generator.__wrapped_original__ = original
    GenerationMixin._get_candidate_generator = _get_candidate_generator


def is_dspark_dispatch_installed() -> bool:
    return bool(getattr(GenerationMixin._get_candidate_generator, _MARKER, False))


__all__ = ["install_dspark_dispatch", "is_dspark_dispatch_installed"]
