"""The one table of training engines: each engine's name, class, verl's ``strategy`` names that run on it, verl
0.9's ``model_engine`` value and packaged config that select it, and its config rules
(``verl/engine/<engine>/config_rules.py``). The config check, the engine registry (:mod:`verl.engine.registry`),
``model_engine`` and the Python API read this table; a third engine is its folder, one row here and its YAML
block.

verl's ``fsdp`` (FSDP1) and ``fsdp2`` both run on FSDP2 here. Torch-free, so that checking a config imports no
engine.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

from verl.errors import InputError

if TYPE_CHECKING:
    from verl.engine.config_rules import BackendConfigRules


@dataclasses.dataclass(frozen=True)
class EngineEntry:
    """One training engine. ``name`` is also what its checkpoints record; ``engine_class`` is ``module:Class``;
    ``strategies`` are verl's role ``strategy`` values it runs (the first is the one ``model_engine`` sets);
    ``model_engine`` and ``default_config`` are verl 0.9's selector value and its packaged config."""

    name: str
    engine_class: str
    strategies: tuple[str, ...]
    model_engine: str
    default_config: str

    @property
    def rules_module(self) -> str:
        return f"verl.engine.{self.name}.config_rules"


ENGINE_TABLE: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("megatron", "verl.engine.megatron.engine:MegatronEngine", ("megatron",), "megatron",
                "ppo_megatron_trainer"),
    EngineEntry("fsdp", "verl.engine.fsdp.engine:FSDPEngine", ("fsdp", "fsdp2"), "dp", "ppo_trainer"),
)}
# verl's strategy -> engine name, derived from the table
STRATEGIES = {strategy: e.name for e in ENGINE_TABLE.values() for strategy in e.strategies}


def engine_name(strategy: str) -> str:
    """The engine that runs ``strategy``."""
    if strategy not in STRATEGIES:
        raise InputError(f"strategy: expected one of {', '.join(STRATEGIES)}, found {strategy!r}")
    return STRATEGIES[strategy]


def engine_entry(strategy: str) -> EngineEntry:
    return ENGINE_TABLE[engine_name(strategy)]


def config_rules(strategy: str) -> BackendConfigRules:
    """The config rules of the engine that runs ``strategy``."""
    return importlib.import_module(engine_entry(strategy).rules_module).RULES
