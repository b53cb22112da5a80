"""``reward``: verl 0.9's reward section, beside the legacy ``reward_model`` keys. Only the keys implemented here
are in the YAML (any other ``reward.*`` key is refused as unknown): each is verl 0.9's name of a legacy key and,
when set (not null), means it (:func:`fold_reward_section`, run by the config loader before the checks);
``num_workers`` is verl's reward pool (the legacy ``reward_model.launch_reward_fn_async``: one worker)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from verl.engine.rollout.registry import ROLLOUT_NAME_CHOICES
from verl.utils.config_checks import ConfigError
from verl.workers.config.rollout import SamplingKeys
from verl.workers.config.section import Section, checked

frozen = dataclasses.dataclass(frozen=True)

# verl 0.9 key -> (the legacy key it means, the legacy key's packaged default)
LEGACY_KEYS = {
    "reward.reward_model.enable": ("reward_model.enable", False),
    "reward.reward_model.model_path": ("reward_model.model.path", None),
    "reward.custom_reward_function.path": ("custom_reward_function.path", None),
    "reward.custom_reward_function.name": ("custom_reward_function.name", "compute_score"),
}


@frozen
class ModuleKeysConfig(Section):
    """``reward.reward_manager.module``: the file (``path``) holding a reward manager class (``name``)."""

    path: str | None
    name: str


@frozen
class RewardManagerKeysConfig(Section):
    """``reward.reward_manager``: ``source=register`` takes ``name`` from the registry (= ``reward_model.
    reward_manager``); ``importlib`` loads the class ``module.name`` from the file ``module.path``."""

    source: str = checked(choices=("register", "importlib"))
    name: str | None
    module: ModuleKeysConfig


@frozen
class JudgeRolloutConfig(SamplingKeys):
    """``reward.reward_model.rollout``: the engine serving a generative reward model (the rollout registry's
    ``name``), its sampling and its token budgets."""

    name: str = checked(choices=ROLLOUT_NAME_CHOICES)
    dtype: str = checked(choices=("float32", "bfloat16", "float16"))
    free_cache_engine: bool
    tensor_model_parallel_size: int = checked(ge=1)
    prompt_length: int = checked(ge=1)
    response_length: int = checked(ge=1)
    seed: int


@frozen
class ParseFunctionConfig(Section):
    """``reward.reward_model.judge.parse_function``: function ``name`` in the file at ``path`` (null: the last
    number in the verdict)."""

    path: str | None
    name: str


@frozen
class JudgeConfig(Section):
    """``reward.reward_model.judge`` (verl-hpc): the prompt a judge reads (``{response}``, optionally
    ``{question}`` and ``{reference}``), how its verdict becomes a score, and what a verdict that timed out or
    did not parse scores. A parsed score is clamped to ``[score_min, score_max]`` (``reward_model/
    judge_clamped_frac``): a verdict of "Score: 1e300" is not the reward."""

    prompt_template: str | None
    parse_function: ParseFunctionConfig
    default_score: float
    timeout_s: float = checked(gt=0)
    score_min: float
    score_max: float

    def __post_init__(self, key: str) -> None:
        super().__post_init__(key)
        if not self.score_min < self.score_max:
            raise ConfigError(f"{key}.score_min: expected less than {key}.score_max={self.score_max}, found "
                              f"{self.score_min}")


@frozen
class RewardModelKeysConfig(Section):
    """``reward.reward_model``: ``enable`` = ``reward_model.enable``, ``model_path`` = ``reward_model.model.path``
    (null: the legacy key decides); ``rollout`` and ``judge``: a generative reward model (LLM judge)."""

    enable: bool | None
    enable_resource_pool: bool
    n_gpus_per_node: int = checked(ge=0)
    nnodes: int = checked(ge=0)
    model_path: str | None
    rollout: JudgeRolloutConfig
    judge: JudgeConfig

    @property
    def is_judge(self) -> bool:
        return self.judge.prompt_template is not None


@frozen
class CustomRewardKeysConfig(Section):
    """``reward.custom_reward_function`` = ``custom_reward_function`` (null: the legacy key decides)."""

    path: str | None
    name: str | None


@frozen
class SandboxFusionConfig(Section):
    """``reward.sandbox_fusion``: verl's HTTP code sandbox; none is reachable here, so ``url`` must stay null."""

    url: str | None
    max_concurrent: int = checked(ge=1)
    memory_limit_mb: int = checked(ge=1)


@frozen
class RewardConfig(Section):
    """``num_workers``: processes scoring rule-based and custom rewards while the step's other passes run
    (:mod:`verl.workers.reward_manager.async_pool`); 0: in the step (after the fold, never null). ``timeout_s``
    (verl-hpc): the longest one sample may score (null: no limit); past it the step ends naming the row."""

    num_workers: int | None = checked(ge=0)
    timeout_s: float | None = checked(gt=0)
    custom_reward_function: CustomRewardKeysConfig
    reward_manager: RewardManagerKeysConfig
    reward_model: RewardModelKeysConfig
    sandbox_fusion: SandboxFusionConfig


def _node(cfg: dict[str, Any], dotted: str) -> tuple[dict[str, Any], str]:
    *parents, leaf = dotted.split(".")
    for part in parents:
        cfg = cfg[part]
    return cfg, leaf


def fold_reward_section(cfg: dict[str, Any], resolve_path: Callable[[str | None], str | None] | None = None) -> None:
    """Each set verl 0.9 key into its legacy key (a composed plain config, in place); one ConfigError line when
    both are set to different values. ``resolve_path``: the config loader's resolution of the section's relative
    file paths (passed in: roles do not import the trainer's loader)."""
    if resolve_path is not None:
        reward = cfg["reward"]
        for node in (reward["reward_manager"]["module"], reward["reward_model"]["judge"]["parse_function"],
                     reward["custom_reward_function"]):
            node["path"] = resolve_path(node["path"])
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
    template = cfg["reward"]["reward_model"]["judge"]["prompt_template"]
    if template is not None:  # the text alone says whether it is a judge's prompt: checked first
        from verl.workers.reward_judge import template_fields

        template_fields(template)
    manager = cfg["reward"]["reward_manager"]
    if manager["source"] == "register" and manager["name"] is not None:
        legacy = cfg["reward_model"]["reward_manager"]
        if legacy != "naive" and legacy != manager["name"]:
            raise ConfigError(f"reward.reward_manager.name: expected the value of reward_model.reward_manager or one "
                              f"of them left unset, found {manager['name']!r} and {legacy!r}")
        cfg["reward_model"]["reward_manager"] = manager["name"]
    elif manager["source"] == "importlib" and manager["module"]["path"] is None:
        raise ConfigError("reward.reward_manager.module.path: expected the .py file defining the reward manager "
                          "class with reward.reward_manager.source=importlib, found null")
    rm = cfg["reward"]["reward_model"]
    if rm["enable_resource_pool"]:
        raise ConfigError("reward.reward_model.enable_resource_pool: expected false (the reward model or judge runs "
                          "on the trainer's ranks, asleep while they train; its own ranks are not implemented), "
                          "found true")
    if cfg["reward"]["sandbox_fusion"]["url"] is not None:
        raise ConfigError(f"reward.sandbox_fusion.url: expected null (no HTTP sandbox is reachable from verl-hpc's "
                          f"ranks), found "
                          f"{cfg['reward']['sandbox_fusion']['url']!r}")
    # The legacy flag means verl's one remote reward task: one worker, unless num_workers says how many.
    reward, async_flag = cfg["reward"], cfg["reward_model"]["launch_reward_fn_async"]
    if async_flag and reward["num_workers"] == 0:
        raise ConfigError("reward.num_workers: expected at least 1 with reward_model.launch_reward_fn_async=true "
                          "(rewards off the critical path), found 0")
    if reward["num_workers"] is None:
        reward["num_workers"] = 1 if async_flag else 0


def check_reward_section(cfg: dict[str, Any]) -> None:
    """The checks of the reward section that read files, before any rank starts: a reward manager class from a
    file loads; a judge template needs a reward model to serve it."""
    reward = cfg["reward"]
    manager = reward["reward_manager"]
    if manager["source"] == "importlib":
        from verl.workers.reward_manager import load_reward_manager_cls

        load_reward_manager_cls(manager["module"]["path"], manager["module"]["name"])
    judge = reward["reward_model"]["judge"]
    if judge["prompt_template"] is not None:
        if not cfg["reward_model"]["enable"]:
            raise ConfigError("reward.reward_model.enable: expected true with reward.reward_model.judge."
                              "prompt_template set (the judge is the reward model), found false")
