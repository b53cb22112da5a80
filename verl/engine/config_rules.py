"""What a training backend says about a PPO config: the rules the config check and the launcher ask the
backend for instead of branching on its name. Each engine folder has one (``verl/engine/<engine>/config_rules``),
found by strategy name through :func:`verl.engine.strategies.config_rules`.

Torch-free, as :mod:`verl.engine.strategies` is: the config is checked before any engine is imported. The
methods read the composed config as a mapping (the loader's dict or the trainer's ``DictConfig``) and raise
:class:`~verl.utils.config_checks.ConfigError` with one line naming the key.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from verl.utils.config_checks import ConfigError

ARR = "actor_rollout_ref"


def check_divides(what: str, divisor: int, total_what: str, total: int) -> None:
    if total % divisor:
        raise ConfigError(f"{what}={divisor}: expected a divisor of {total_what}={total}, "
                          f"found remainder {total % divisor}")


class BackendConfigRules(abc.ABC):
    """One training backend's config rules. ``model_engine``: verl 0.9's ``model_engine`` value that selects
    it; ``sections``: the role keys only this backend reads (set on another backend they do nothing)."""

    model_engine: str
    sections: tuple[str, ...]

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
