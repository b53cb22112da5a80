"""``critic``: the value model and its PPO updates (verl's ``CriticConfig``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.algorithms.core_algos import LOSS_AGG_MODES
from verl.engine.strategies import STRATEGY_NAMES
from verl.workers.config.engine import (
    CheckpointConfig,
    CriticFSDPConfig,
    CriticMcoreConfig,
    LoRAModelKeys,
    OptimizerConfig,
)
from verl.workers.config.section import Section, checked

frozen = dataclasses.dataclass(frozen=True)


@frozen
class CriticModelConfig(LoRAModelKeys):
    """``critic.model`` (path null: the actor's model), with the actor's LoRA keys (:class:`LoRAModelKeys`); the
    value head trains in full beside the adapters."""

    path: str | None
    tokenizer_path: str | None
    override_config: Mapping[str, Any]
    trust_remote_code: bool
    use_remove_padding: bool
    enable_gradient_checkpointing: bool | None  # None: chosen by memory (recompute_choice), off until chosen


@frozen
class CriticConfig(Section):
    strategy: str = checked(choices=STRATEGY_NAMES)
    enable: bool | None
    model: CriticModelConfig
    ppo_mini_batch_size: int = checked(ge=1)
    ppo_micro_batch_size: int | None = checked(ge=1)
    ppo_micro_batch_size_per_gpu: int = checked(ge=1)
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int
    forward_max_token_len_per_gpu: int
    ppo_epochs: int = checked(ge=1)
    shuffle: bool
    data_loader_seed: int
    cliprange_value: float = checked(gt=0)
    loss_agg_mode: str = checked(choices=LOSS_AGG_MODES)
    optim: OptimizerConfig
    megatron: CriticMcoreConfig
    grad_clip: float = checked(ge=0)
    fsdp_config: CriticFSDPConfig
    checkpoint: CheckpointConfig
