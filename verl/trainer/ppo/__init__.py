"""PPO-family algorithms: advantage estimators, losses, KL control; ``PPOTrainer`` (the single-controller trainer,
:mod:`verl.trainer.ppo.trainer`), imported on first use so that ``verl.trainer.ppo.core_algos`` stays light."""

__all__ = ["PPOTrainer"]


def __getattr__(name: str):
    if name == "PPOTrainer":
        from verl.trainer.ppo.trainer import PPOTrainer

        return PPOTrainer
    raise AttributeError(f"module 'verl.trainer.ppo' has no attribute {name!r}")
