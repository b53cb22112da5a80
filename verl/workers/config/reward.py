"""``reward``: verl 0.9's reward section, beside the legacy ``reward_model`` keys. Only the keys implemented here
are in the YAML (any other ``reward.*`` key is refused as unknown): each is verl 0.9's name of a legacy key and,
when set (not null), means it (:func:`fold_reward_section`, run by the config loader before the checks);
``num_workers`` is verl's reward pool (the legacy ``reward_model.launch_reward_fn_async``: one worker)."""

from __future__ import annotations

import dataclasses
from typing import Any

from verl.utils.config_checks import ConfigError
from verl.workers.config.section import Section, checked

frozen = dataclasses.dataclass(frozen=True)

# verl 0.9 key -> (the legacy key it means, the legacy key's packaged default)
LEGACY_KEYS = {
    "reward.reward_model.enable": ("reward_model.enable", False),
    "reward.reward_model.model_path": ("reward_model.model.path", None),
}


@frozen
class RewardModelKeysConfig(Section):
    """``reward.reward_model``: ``enable`` = ``reward_model.enable``, ``model_path`` = ``reward_model.model.path``
    (null: the legacy key decides)."""

    enable: bool | None
    model_path: str | None


@frozen
class RewardConfig(Section):
    """``num_workers``: processes scoring rule-based and custom rewards while the step's other passes run
    (:mod:`verl.workers.reward_manager.async_pool`); 0: in the step (after the fold, never null)."""

    num_workers: int | None = checked(ge=0)
    reward_model: RewardModelKeysConfig


def _node(cfg: dict[str, Any], dotted: str) -> tuple[dict[str, Any], str]:
    *parents, leaf = dotted.split(".")
    for part in parents:
        cfg = cfg[part]
    return cfg, leaf


def fold_reward_section(cfg: dict[str, Any]) -> None:
    """Each set verl 0.9 key into its legacy key (a composed plain config, in place); one ConfigError line when
    both are set to different values."""
    for new, (legacy, default) in LEGACY_KEYS.items():
        node, leaf = _node(cfg, new)
        value = node[leaf]
        if value is None:
            continue
        old_node, old_leaf = _node(cfg, legacy)
        if old_node[old_leaf] != default and old_node[old_leaf] != value:
            raise ConfigError(f"{new}: expected the value of {legacy} (the same key in verl 0.9's reward section) "
                              f"or one of them left unset, found {value!r} and {legacy}={old_node[old_leaf]!r}")
        old_node[old_leaf] = value
    # The legacy flag means verl's one remote reward task: one worker, unless num_workers says how many.
    reward, async_flag = cfg["reward"], cfg["reward_model"]["launch_reward_fn_async"]
    if async_flag and reward["num_workers"] == 0:
        raise ConfigError("reward.num_workers: expected at least 1 with reward_model.launch_reward_fn_async=true "
                          "(rewards off the critical path), found 0")
    if reward["num_workers"] is None:
        reward["num_workers"] = 1 if async_flag else 0
