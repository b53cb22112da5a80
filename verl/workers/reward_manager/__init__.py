"""Reward managers: turn decoded responses into token-level scores."""

from verl.errors import InputError
from verl.workers.reward_manager.naive import NaiveRewardManager

REWARD_MANAGER_REGISTRY = {"naive": NaiveRewardManager}


def get_reward_manager_cls(name: str):
    """The reward manager class registered as ``reward_model.reward_manager`` = ``name``."""
    if name not in REWARD_MANAGER_REGISTRY:
        raise InputError(
            f"reward_model.reward_manager: expected one of {sorted(REWARD_MANAGER_REGISTRY)}, found {name!r}"
        )
    return REWARD_MANAGER_REGISTRY[name]


__all__ = ["NaiveRewardManager", "get_reward_manager_cls", "REWARD_MANAGER_REGISTRY"]
