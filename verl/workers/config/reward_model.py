"""``reward_model``: the model-based reward, forward-only in the actor's layout, hot-swappable."""

from __future__ import annotations

import dataclasses

from verl.engine.strategies import STRATEGY_NAMES
from verl.workers.config.engine import RewardModelFSDPConfig, RewardModelMcoreConfig
from verl.workers.config.section import Section, checked

frozen = dataclasses.dataclass(frozen=True)


@frozen
class RewardModelPathConfig(Section):
    """``reward_model.model``."""

    input_tokenizer: str | None
    path: str | None
    trust_remote_code: bool


@frozen
class HotSwapConfig(Section):
    """``reward_model.hot_swap``: reload when ``model.path`` changes (watch), or load ``path`` at ``at_step``."""

    watch: bool
    path: str | None
    at_step: int | None = checked(ge=1)


@frozen
class RewardModelConfig(Section):
    enable: bool
    strategy: str = checked(choices=STRATEGY_NAMES)
    model: RewardModelPathConfig
    micro_batch_size: int | None = checked(ge=1)
    micro_batch_size_per_gpu: int = checked(ge=1)
    max_length: int | None = checked(ge=1)
    reward_manager: str = checked(choices=("naive",))
    launch_reward_fn_async: bool
    megatron: RewardModelMcoreConfig
    fsdp_config: RewardModelFSDPConfig
    hot_swap: HotSwapConfig
