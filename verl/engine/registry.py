"""verl's training ``strategy`` -> the engine class that runs it (the table: :mod:`verl.engine.strategies`).

Engine classes are imported on first use, so an FSDP run never imports Megatron-core.
"""

from __future__ import annotations

import importlib

from verl.engine.base import EngineSpec, TrainingEngine
from verl.engine.strategies import STRATEGIES, engine_entry, engine_name

__all__ = ["STRATEGIES", "build_engine", "engine_class", "engine_name"]


def engine_class(strategy: str) -> type[TrainingEngine]:
    """The row's class: ``module:Class`` imported on first use, or the class itself (a registered engine's)."""
    spec = engine_entry(strategy).engine_class
    if not isinstance(spec, str):
        return spec
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def build_engine(strategy: str, spec: EngineSpec) -> TrainingEngine:
    """The engine of ``strategy`` for a role (see :class:`EngineSpec`)."""
    return engine_class(strategy).from_spec(spec)
