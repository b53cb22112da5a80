"""verl's training ``strategy`` -> the engine class that runs it (the names: :mod:`verl.engine.strategies`).

Engine classes are imported on first use, so an FSDP run never imports Megatron-core.
"""

from __future__ import annotations

import importlib

from verl.engine.base import EngineSpec, TrainingEngine
from verl.engine.strategies import STRATEGIES, engine_name

__all__ = ["ENGINES", "STRATEGIES", "build_engine", "engine_class", "engine_name"]

# engine name -> its class ("module:Class"); the engine name is also what its checkpoints record.
ENGINES = {"megatron": "verl.engine.megatron.engine:MegatronEngine",
           "fsdp": "verl.engine.fsdp.engine:FSDPEngine"}


def engine_class(strategy: str) -> type[TrainingEngine]:
    module, name = ENGINES[engine_name(strategy)].split(":")
    return getattr(importlib.import_module(module), name)


def build_engine(strategy: str, spec: EngineSpec) -> TrainingEngine:
    """The engine of ``strategy`` for a role (see :class:`EngineSpec`)."""
    return engine_class(strategy).from_spec(spec)
