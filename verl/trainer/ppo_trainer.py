"""``from verl.trainer.ppo_trainer import PPOTrainer``: the documents' module name for the PPO trainer
(:mod:`verl.trainer.ppo.trainer`)."""

from verl.trainer.ppo.trainer import PPOTrainer

__all__ = ["PPOTrainer"]
