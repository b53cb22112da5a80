"""Reward managers: turn decoded responses into token-level scores."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from verl.errors import InputError
from verl.utils.config_checks import ConfigError
from verl.workers.reward_manager.naive import NaiveRewardManager

REWARD_MANAGER_REGISTRY = {"naive": NaiveRewardManager}


def get_reward_manager_cls(name: str):
    """The reward manager class registered as ``reward_model.reward_manager`` = ``name``."""
    if name not in REWARD_MANAGER_REGISTRY:
        raise InputError(
            f"reward_model.reward_manager: expected one of {sorted(REWARD_MANAGER_REGISTRY)}, found {name!r}"
        )
    return REWARD_MANAGER_REGISTRY[name]


def load_reward_manager_cls(path: str, name: str):
    """verl's ``reward.reward_manager.source=importlib``: the class ``name`` in the Python file at ``path`` (the
    file is executed: point it at code you trust). It is built like the naive manager: ``cls(tokenizer,
    num_examine=, compute_score=, reward_fn_key=)``, and called as ``manager(data, return_dict=False)``."""
    key = "reward.reward_manager.module"
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ConfigError(f"{key}.path: expected a .py file defining the reward manager class, found no file at {path}")
    spec = importlib.util.spec_from_file_location("verl_custom_reward_manager_" +
                                                  os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ConfigError(f"{key}.path: importing {path} failed: {type(err).__name__}: {err}") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        found = "nothing" if cls is None else type(cls).__name__
        raise ConfigError(f"{key}.name: expected a reward manager class {name!r} in {path}, found {found}")
    return cls


def reward_manager_cls(sections: Any):
    """The reward manager class a PPO config names: ``reward.reward_manager`` (verl 0.9: the registry, or a class
    in a file with ``source=importlib``), else the legacy ``reward_model.reward_manager``."""
    manager = sections.reward.reward_manager
    if manager.source == "importlib":
        return load_reward_manager_cls(manager.module.path, manager.module.name)
    return get_reward_manager_cls(sections.reward_model.reward_manager)


__all__ = ["NaiveRewardManager", "get_reward_manager_cls", "load_reward_manager_cls", "reward_manager_cls",
           "REWARD_MANAGER_REGISTRY"]
