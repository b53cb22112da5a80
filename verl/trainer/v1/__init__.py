"""verl's V1 trainer modes: ``sync`` (the PPO loop, :class:`verl.trainer.ppo.trainer.PPOTrainer`),
``colocate_async`` (:mod:`.colocate_async`) and ``separate_async`` (:mod:`.separate_async`), over the replay buffer of
prompt groups (:mod:`.replay_buffer`)."""

from __future__ import annotations

from typing import Any


def trainer_class(config: Any) -> type:
    """The trainer ``trainer.v1.trainer_mode`` names (verl's legacy trainer, ``use_v1=false``, is sync)."""
    from verl.trainer.config.ppo import trainer_mode

    mode = trainer_mode(config)
    if mode == "colocate_async":
        from verl.trainer.v1.colocate_async import ColocateAsyncTrainer

        return ColocateAsyncTrainer
    if mode == "separate_async":
        from verl.trainer.v1.separate_async import SeparateAsyncTrainer

        return SeparateAsyncTrainer
    from verl.trainer.ppo.trainer import PPOTrainer

    return PPOTrainer
