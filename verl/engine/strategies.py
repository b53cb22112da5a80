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
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from verl.errors import InputError
from verl.utils.registry_names import RegistryNames

if TYPE_CHECKING:
    from verl.engine.config_rules import BackendConfigRules


@dataclasses.dataclass(frozen=True)
class EngineEntry:
    """One training engine. ``name`` is also what its checkpoints record; ``engine_class`` its class;
    ``strategies`` are verl's role ``strategy`` values it runs (the first is the one ``model_engine`` sets);
    ``model_engine`` and ``default_config`` are verl 0.9's selector value and its packaged config."""

    name: str
    engine_class: str | type  # "module:Class", or the class (an engine registered from a user's module)
    strategies: tuple[str, ...]
    model_engine: str
    default_config: str
    # ``module`` whose ``RULES`` are the engine's config rules; default ``verl.engine.<name>.config_rules``
    rules: str | None = None
    # trains transformers' own modules, so a PEFT model's LoRA adapter loads onto them as it is
    transformers_modules: bool = False

    @property
    def rules_module(self) -> str:
        return self.rules or f"verl.engine.{self.name}.config_rules"


ENGINE_TABLE: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("megatron", "verl.engine.megatron.engine:MegatronEngine", ("megatron",), "megatron",
                "ppo_megatron_trainer"),
    EngineEntry("fsdp", "verl.engine.fsdp.engine:FSDPEngine", ("fsdp", "fsdp2"), "dp", "ppo_trainer",
                transformers_modules=True),
)}
# verl's strategy -> engine name, derived from the table (kept in step with it by register_engine)
STRATEGIES = {strategy: e.name for e in ENGINE_TABLE.values() for strategy in e.strategies}


class _ModelEngines(Mapping):
    """verl 0.9's ``model_engine`` value -> (its packaged config, the strategy it sets), read from the table when
    asked, so an engine registered after import is selectable."""

    def _table(self) -> dict[str, tuple[str, str]]:
        return {e.model_engine: (e.default_config, e.strategies[0]) for e in ENGINE_TABLE.values()}

    def __getitem__(self, key: str) -> tuple[str, str]:
        return self._table()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


MODEL_ENGINES = _ModelEngines()


STRATEGY_NAMES = RegistryNames(STRATEGIES)  # verl's role ``strategy`` values
MODEL_ENGINE_NAMES = RegistryNames(MODEL_ENGINES)  # verl 0.9's ``model_engine`` values


def register_engine(entry: EngineEntry) -> EngineEntry:
    """Add a training engine's row (an engine in a user's module, named by ``actor_rollout_ref.model.external_lib``,
    or a test's); its strategies and ``model_engine`` must be new."""
    taken = sorted(set(entry.strategies) & set(STRATEGIES))
    if entry.name in ENGINE_TABLE or taken or entry.model_engine in MODEL_ENGINES:
        raise ValueError(f"training engine {entry.name!r}: expected a new name, strategies and model_engine, found "
                         f"{entry.name if entry.name in ENGINE_TABLE else taken or entry.model_engine!r} registered")
    ENGINE_TABLE[entry.name] = entry
    STRATEGIES.update({strategy: entry.name for strategy in entry.strategies})
    return entry


def engine_name(strategy: str) -> str:
    """The engine that runs ``strategy``."""
    if strategy not in STRATEGIES:
        raise InputError(f"strategy: expected one of {', '.join(STRATEGIES)}, found {strategy!r}")
    return STRATEGIES[strategy]


def engine_entry(strategy: str) -> EngineEntry:
    return ENGINE_TABLE[engine_name(strategy)]


def peft_strategy(strategy: str | None, who: str) -> str:
    """The strategy a PEFT model's LoRA adapter trains under (it sits on transformers' linears, so an engine that
    trains those modules takes it as it is): ``strategy`` when its engine does, the first such one for None."""
    fitting = [s for s, name in STRATEGIES.items() if ENGINE_TABLE[name].transformers_modules]
    if strategy is None:
        return fitting[0]
    if strategy not in fitting:
        raise InputError(f"{who} strategy={strategy!r}: expected one of {fitting} (PEFT's LoRA on transformers' "
                         f"linears), found {strategy!r}")
    return strategy


def config_rules(strategy: str) -> BackendConfigRules:
    """The config rules of the engine that runs ``strategy``."""
    return importlib.import_module(engine_entry(strategy).rules_module).RULES
