"""verl's V1 trainer modes: ``sync`` (the PPO loop, :class:`verl.trainer.ppo.trainer.PPOTrainer`),
``colocate_async`` (:mod:`.colocate_async`) and ``separate_async`` (:mod:`.separate_async`), over the replay buffer of
prompt groups (:mod:`.replay_buffer`)."""

from __future__ import annotations

from typing import Any

# trainer.v1.trainer_mode -> "module:Class" (imported when the mode runs)
TRAINERS = {
    "sync": "verl.trainer.ppo.trainer:PPOTrainer",
    "colocate_async": "verl.trainer.v1.colocate_async:ColocateAsyncTrainer",
    "separate_async": "verl.trainer.v1.separate_async:SeparateAsyncTrainer",
}


def trainer_module(config: Any) -> str:
    """The module of the trainer ``trainer.v1.trainer_mode`` names (verl's legacy trainer, ``use_v1=false``, is
    sync), without importing it."""
    from verl.trainer.config.ppo import trainer_mode

    return TRAINERS.get(trainer_mode(config), TRAINERS["sync"]).partition(":")[0]


def trainer_class(config: Any) -> type:
    """The trainer ``trainer.v1.trainer_mode`` names."""
    import importlib

    from verl.trainer.config.ppo import trainer_mode

    module, _, name = TRAINERS.get(trainer_mode(config), TRAINERS["sync"]).partition(":")
    return getattr(importlib.import_module(module), name)
