"""verl's training ``strategy`` names and the engine each one runs on: the one table the config check and the
engine registry (:mod:`verl.engine.registry`) both read, and each engine's config rules
(:mod:`verl.engine.config_rules`), which the config check asks instead of branching on the backend.

verl's ``fsdp`` (FSDP1) and ``fsdp2`` both run on FSDP2 here. Torch-free, so that checking a config imports no
engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from verl.errors import InputError

if TYPE_CHECKING:
    from verl.engine.config_rules import BackendConfigRules

STRATEGIES = {"megatron": "megatron", "fsdp": "fsdp", "fsdp2": "fsdp"}  # verl's strategy -> engine name


def engine_name(strategy: str) -> str:
    """The engine (megatron | fsdp) that runs ``strategy``."""
    if strategy not in STRATEGIES:
        raise InputError(f"strategy: expected one of {', '.join(STRATEGIES)}, found {strategy!r}")
    return STRATEGIES[strategy]


def config_rules(strategy: str) -> BackendConfigRules:
    """The config rules of the engine that runs ``strategy`` (``verl/engine/<engine>/config_rules.py``)."""
    return importlib.import_module(f"verl.engine.{engine_name(strategy)}.config_rules").RULES
