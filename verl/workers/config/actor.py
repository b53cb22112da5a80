"""``actor_rollout_ref``: the actor, its reference copy, the rollout and the model they share (verl's
``ActorConfig``, ``RefConfig`` and the worker's section)."""

from __future__ import annotations

import dataclasses

from verl.algorithms.core_algos import KL_PENALTY_CHOICES, LOSS_AGG_MODES, POLICY_LOSS_NAMES
from verl.engine.strategies import STRATEGY_NAMES
from verl.workers.config.engine import (
    CheckpointConfig,
    FSDPEngineConfig,
    HFModelConfig,
    McoreEngineConfig,
    OptimizerConfig,
    RefFSDPConfig,
    RefMcoreConfig,
)
from verl.workers.config.rollout import LogProbBatchKeys, RolloutConfig
from verl.workers.config.section import Section, checked

frozen = dataclasses.dataclass(frozen=True)


@frozen
class PolicyLossConfig(Section):
    """``actor.policy_loss``: the registered policy loss (core_algos.register_policy_loss, also by the modules
    ``actor_rollout_ref.model.external_lib`` names: the choices are the registry's when checked)."""

    loss_mode: str = checked(choices=POLICY_LOSS_NAMES)


@frozen
class RouterReplayConfig(Section):
    """``actor.router_replay``: MoE routing replay. R3 routes the actor's log-prob and update forward passes by
    the rollout's recorded experts (``rollout.enable_rollout_routing_replay``)."""

    mode: str = checked(choices=("disabled", "R2", "R3"))
    record_file: str | None
    replay_file: str | None


@frozen
class ActorConfig(Section):
    """``actor_rollout_ref.actor``: PPO's policy update and the training engine it runs on."""

    strategy: str = checked(choices=STRATEGY_NAMES)
    ppo_mini_batch_size: int = checked(ge=1)
    ppo_micro_batch_size: int | None = checked(ge=1)
    ppo_micro_batch_size_per_gpu: int = checked(ge=1)
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int = checked(ge=1)
    clip_ratio: float = checked(gt=0)
    clip_ratio_low: float = checked(gt=0)
    clip_ratio_high: float = checked(gt=0)
    clip_ratio_c: float = checked(gt=1)
    policy_loss: PolicyLossConfig
    router_replay: RouterReplayConfig
    loss_agg_mode: str = checked(choices=LOSS_AGG_MODES)
    loss_scale_factor: float | None = checked(gt=0)
    entropy_coeff: float = checked(ge=0)
    use_kl_loss: bool
    kl_loss_coef: float = checked(ge=0)
    kl_loss_type: str = checked(choices=KL_PENALTY_CHOICES)
    ppo_epochs: int = checked(ge=1)
    recompute_on_policy_old_log_prob: bool
    shuffle: bool
    data_loader_seed: int
    use_torch_compile: bool
    optim: OptimizerConfig
    megatron: McoreEngineConfig
    checkpoint: CheckpointConfig
    grad_clip: float = checked(ge=0)
    fsdp_config: FSDPEngineConfig


@frozen
class RefConfig(LogProbBatchKeys):
    """``actor_rollout_ref.ref``: the forward-only reference policy, in the actor's layout."""

    strategy: str = checked(choices=STRATEGY_NAMES)
    megatron: RefMcoreConfig
    fsdp_config: RefFSDPConfig


@frozen
class ActorRolloutRefConfig(Section):
    """``actor_rollout_ref``: what the actor/rollout/reference worker is built from."""

    hybrid_engine: bool
    nccl_timeout: int
    model: HFModelConfig
    actor: ActorConfig
    ref: RefConfig
    rollout: RolloutConfig
