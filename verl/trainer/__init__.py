"""Trainers: the single-controller RL dataflow and its algorithms.

The one import from this package up into :mod:`verl.api` is ``from verl.trainer import RLTrainer`` (the Python API's
documented spelling, docs/python_api.md): it resolves on first use, so nothing under ``verl.trainer`` imports the API
it serves."""

__all__ = ["RLTrainer"]


def __getattr__(name: str):
    # ``from verl.trainer import RLTrainer`` (document 002): the Python API's trainer of a DataPipeline, imported
    # when asked for (verl.api sits above the trainer, which never needs it).
    if name == "RLTrainer":
        from verl.api.pipeline import RLTrainer

        return RLTrainer
    raise AttributeError(f"module 'verl.trainer' has no attribute {name!r}")
