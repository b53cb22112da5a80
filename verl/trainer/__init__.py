"""Trainers: the single-controller RL dataflow and its algorithms, and (:mod:`verl.trainer.api`) the Python API's
objects over them, which :mod:`verl.api` re-exports.

``from verl.trainer import RLTrainer`` (the Python API's documented spelling, docs/python_api.md) resolves on first
use, so ``import verl.trainer`` stays as light as before."""

__all__ = ["RLTrainer"]


def __getattr__(name: str):
    # ``from verl.trainer import RLTrainer`` (document 002): the Python API's trainer of a DataPipeline, imported
    # when asked for, since it pulls in the engines and the PPO trainer.
    if name == "RLTrainer":
        from verl.trainer.api.pipeline import RLTrainer

        return RLTrainer
    raise AttributeError(f"module 'verl.trainer' has no attribute {name!r}")
