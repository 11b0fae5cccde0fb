"""Loading the CPU engine (``dspark_cpu``, the ``dspark-cpu`` distribution in ``cpu_engine/``) when it is
installed: the one place the DSpark core names it.

The engine prepares a model for fast decoding on CPU (``dspark_cpu.optimize_for_cpu``: packed linears, its own
kernels, a lean decoder forward). DSpark's decoding does not need it: outputs are the same within rounding
either way, only slower on CPU. So the tools that prepare a target (``dspark-hf bench``, ``dspark-hf profile``,
``dspark-hf train``, ``dspark-hf datagen``) call :func:`prepare_for_cpu`, which uses the engine where it is
installed and otherwise logs that the stock model runs (a warning the first time in a process) and how to
install the engine; results are kept either way. :func:`load_engine` is for code that needs the engine itself (``dspark_hf.optimize_for_cpu``): it raises
:class:`CpuEngineNotInstalled`, an ``ImportError`` that says how to install it.

The engine is imported by name (:data:`ENGINE_MODULE`) with :mod:`importlib`: no core module imports it
(``tests/test_layout.py`` checks this).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = ["CpuEngineNotInstalled", "ENGINE_MODULE", "INSTALL_HINT", "engine_available", "load_engine",
           "prepare_for_cpu"]

ENGINE_MODULE = "dspark_cpu"
INSTALL_HINT = ("install it with `pip install -e ./cpu_engine` from a checkout of the dspark_hf repository "
                "(the README's install command does)")
_warned: list[bool] = []


class CpuEngineNotInstalled(ImportError):
    """The CPU engine (``dspark_cpu``) is not installed."""


def load_engine() -> ModuleType:
    """The CPU engine's module ``dspark_cpu``; :class:`CpuEngineNotInstalled` (an ``ImportError``) saying how
    to install it where it is missing."""
    try:
        return importlib.import_module(ENGINE_MODULE)
    except ModuleNotFoundError as error:
        if error.name != ENGINE_MODULE:  # the engine is there but something it imports is not: say that
            raise
        raise CpuEngineNotInstalled(f"The dspark_hf CPU engine ({ENGINE_MODULE}) is not installed; "
                                    f"{INSTALL_HINT}.") from error


def engine_available() -> bool:
    """Whether the CPU engine can be imported here."""
    try:
        load_engine()
    except CpuEngineNotInstalled:
        return False
    return True


def prepare_for_cpu(model: Any, **options: Any) -> Any:
    """``dspark_cpu.optimize_for_cpu(model, **options)`` where the engine is installed; otherwise ``model`` as
    it is, with a logged line (a warning the first time in a process) saying that the stock model runs and how
    to install the engine (nothing is logged for a model with no weights on the CPU, which the engine would
    leave as it is). Returns the model."""
    try:
        engine = load_engine()
    except CpuEngineNotInstalled as error:
        if not _has_cpu_weights(model):  # the engine leaves models on other devices as they are anyway
            return model
        # A warning the first time in a process, an info line after: never silent, never a wall of warnings.
        log = logger.info if _warned else logger.warning
        _warned.append(True)
        log("%s The stock %s runs (the same outputs within rounding, slower on CPU; step-rate profiles are "
            "keyed apart from a prepared model's).", error, type(model).__name__)
        return model
    return engine.optimize_for_cpu(model, **options)


def _has_cpu_weights(model: Any) -> bool:
    parameters = getattr(model, "parameters", None)
    return callable(parameters) and any(p.device.type == "cpu" for p in parameters())
