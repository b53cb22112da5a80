"""verl's training ``strategy`` names -> the engine that runs them: the one place the choice is made.

verl's ``fsdp`` (FSDP1) and ``fsdp2`` both run on FSDP2 here. Engine classes are imported on first use, so
an FSDP run never imports Megatron-core and a config check imports neither.
"""

from __future__ import annotations

import importlib

from verl.engine.base import EngineSpec, TrainingEngine
from verl.errors import InputError

# engine name -> its class ("module:Class"); the engine name is also what its checkpoints record.
ENGINES = {"megatron": "verl.engine.megatron.engine:MegatronEngine",
           "fsdp": "verl.engine.fsdp.engine:FSDPEngine"}
STRATEGIES = {"megatron": "megatron", "fsdp": "fsdp", "fsdp2": "fsdp"}  # verl's strategy -> engine name


def engine_name(strategy: str) -> str:
    """The engine (megatron | fsdp) that runs ``strategy``."""
    if strategy not in STRATEGIES:
        raise InputError(f"strategy: expected one of {', '.join(STRATEGIES)}, found {strategy!r}")
    return STRATEGIES[strategy]


def engine_class(strategy: str) -> type[TrainingEngine]:
    module, name = ENGINES[engine_name(strategy)].split(":")
    return getattr(importlib.import_module(module), name)


def build_engine(strategy: str, spec: EngineSpec) -> TrainingEngine:
    """The engine of ``strategy`` for a role (see :class:`EngineSpec`)."""
    return engine_class(strategy).from_spec(spec)
