"""The seams a compute engine plugs into: what the DSpark core asks of a model an engine prepared, without
importing the engine.

An engine (the CPU engine, ``dspark_cpu``, is the one there is) changes how a model runs: it packs linear
layers, replaces a decoder's forward, and so on. Two places in the core need to know about that:

* **the packing hook**: a draft with a reduced draft vocabulary gathers rows of its LM head into a new
  ``nn.Linear`` (:func:`dspark_hf.model.draft_vocab.gathered_head`); where the engine prepared that head,
  the new layer should run the same way. The core calls :func:`pack_like` ``(source, module)``; every
  engine's hook gets the chance to prepare ``module`` like ``source`` and returns it (the same object,
  changed in place or not, or a replacement).
* **the backend fingerprint**: a step-rate profile measured on a prepared model must not be reused for a
  stock one, nor for one prepared by other engine code (:func:`dspark_hf.scheduling.step_rates.sps_cache_key`).
  The core calls :func:`backend_fingerprint` ``(model)``: a JSON-ready dict merged from every engine's
  ``fingerprint(model)``, each returning ``{}`` for a model it did not prepare.

An engine registers both with :func:`register_engine` when it is imported (``import dspark_cpu`` does); a
model an engine prepared was prepared by code of that engine, so it is registered by then. This module
imports nothing of the core or of any engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["EngineHooks", "backend_fingerprint", "pack_like", "register_engine", "registered_engines"]

Fingerprint = Callable[[nn.Module], dict[str, Any]]
PackLike = Callable[[nn.Module, nn.Module], nn.Module]


@dataclass(frozen=True)
class EngineHooks:
    """What one engine registered: ``fingerprint(model) -> dict`` and ``pack_like(source, module) -> module``."""

    fingerprint: Fingerprint | None = None
    pack_like: PackLike | None = None


_ENGINES: dict[str, EngineHooks] = {}


def register_engine(name: str, *, fingerprint: Fingerprint | None = None, pack_like: PackLike | None = None) -> None:
    """Registers (or, for a name registered before, replaces) engine ``name``'s hooks.

    ``fingerprint(model)`` returns what about ``model``'s preparation moves its step times (a JSON-ready dict;
    ``{}`` for a model this engine did not touch). ``pack_like(source, module)`` prepares ``module`` the way
    ``source`` is prepared and returns it, or returns ``module`` unchanged where ``source`` is not this engine's.
    """
    _ENGINES[name] = EngineHooks(fingerprint=fingerprint, pack_like=pack_like)


def registered_engines() -> dict[str, EngineHooks]:
    """The engines registered in this process, by name (a copy)."""
    return dict(_ENGINES)


def backend_fingerprint(model: nn.Module) -> dict[str, Any]:
    """How the registered engines prepared ``model``: their fingerprints merged under their names (an engine
    whose fingerprint is empty adds nothing, so a stock model's is ``{}`` with or without engines)."""
    merged = {}
    for name, hooks in sorted(_ENGINES.items()):
        if hooks.fingerprint is not None:
            fingerprint = hooks.fingerprint(model)
            if fingerprint:
                merged[name] = fingerprint
    return merged


def pack_like(source: nn.Module, module: nn.Module) -> nn.Module:
    """``module`` prepared the way ``source`` is by whichever registered engine prepared ``source``; ``module``
    unchanged where none did (or none is registered)."""
    for _, hooks in sorted(_ENGINES.items()):
        if hooks.pack_like is not None:
            module = hooks.pack_like(source, module)
    return module
