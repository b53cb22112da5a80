"""What a training backend says about a PPO config: the rules the config check and the launcher ask the
backend for instead of branching on its name. Each engine folder has one (``verl/engine/<engine>/config_rules``),
found by strategy name through :func:`verl.engine.strategies.config_rules`.

Torch-free, as :mod:`verl.engine.strategies` is: the config is checked before any engine is imported. The
methods read the composed config as a mapping (the loader's dict or the trainer's ``DictConfig``) and raise
:class:`~verl.utils.config_checks.ConfigError` with one line naming the key.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.utils.config_checks import ConfigError

ARR = "actor_rollout_ref"


def check_divides(what: str, divisor: int, total_what: str, total: int) -> None:
    if total % divisor:
        raise ConfigError(f"{what}={divisor}: expected a divisor of {total_what}={total}, "
                          f"found remainder {total % divisor}")


@dataclasses.dataclass(frozen=True)
class LoRAKeys:
    """How a backend reads verl's LoRA keys and names what LoRA touches: what :mod:`verl.engine.lora` asks instead
    of the backend's name."""

    name: str                  # the strategy as messages name it
    block: bool                # verl's ``model.lora`` block (rank, alpha, dropout, ...); else the flat ``lora_rank``,
                               # ``lora_alpha``, ``target_modules`` keys (verl's FSDP keys)
    value_head: str            # the critic's value head module: trained beside the adapters
    all_linear_keyword: bool   # ``target_modules: all-linear`` means every linear (PEFT's keyword)


@dataclasses.dataclass(frozen=True)
class MemoryLayout:
    """What a memory estimate of the actor needs from its backend's keys (the layout sizes come from
    :meth:`BackendConfigRules.model_parallel_sizes`): the training dtype's name, sequence parallelism, the expert
    layout, and whether the optimizer state is split over the data-parallel ranks."""

    dtype: str = "float32"
    sequence_parallel: bool = False
    ep: int = 1
    etp: int | None = None
    distributed_optimizer: bool = True


class BackendConfigRules(abc.ABC):
    """One training backend's config rules. ``sections``: the role keys only this backend reads (set on another
    backend they do nothing); ``lora``: how it reads verl's LoRA keys."""

    sections: tuple[str, ...]
    lora: LoRAKeys

    @abc.abstractmethod
    def lora_candidate_modules(self, model: Any) -> list[str]:
        """The linear modules LoRA may target in ``model`` (a ModelConfig), by the names ``target_modules``
        match on this backend."""

    @abc.abstractmethod
    def model_parallel_sizes(self, actor: Mapping[str, Any]) -> tuple[int, int]:
        """The actor's (tp, pp) from its section ``actor``: the DP size is the world over their product."""

    @abc.abstractmethod
    def check_layout(self, cfg: Mapping[str, Any], model: Any, world: int) -> None:
        """The actor's parallel layout against ``model`` (a :class:`~verl.models.config.ModelConfig`) and the
        world size."""

    @abc.abstractmethod
    def check_role_layouts(self, cfg: Mapping[str, Any], sections: Mapping[str, Any]) -> None:
        """The colocated roles' (``sections``: dotted name -> section, the roles that run) layouts against the
        actor's: they share one process, so one parallel state."""

    @abc.abstractmethod
    def memory_estimate(self, cfg: Mapping[str, Any], dp: int) -> str:
        """The actor's estimated memory per rank for the config's layout (``dp``: its DP size), one line."""

    def memory_layout(self, cfg: Mapping[str, Any]) -> MemoryLayout:
        """The actor's :class:`MemoryLayout` (default: fp32, no sequence parallelism, no experts split, a sharded
        optimizer), for the estimates that choose activation recompute."""
        return MemoryLayout()
