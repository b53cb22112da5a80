"""verl-hpc as a Python library (docs/python_api.md): the objects are the engines, workers and PPO trainer that
`verl train` runs. This package is the public namespace; the objects live with the trainers they drive, in
:mod:`verl.trainer.api`.

- :class:`DataFlow`, :func:`register`, :class:`TrainerConfig` (:mod:`verl.trainer.api.dataflow`): RL as named nodes;
- :class:`DataPipeline`, :class:`RLTrainer`, :func:`is_driver` (:mod:`verl.trainer.api.pipeline`): a job named by its
  models (actors, reward models, critics) over the dataflow trainer; ``verl.metrics`` holds what it returns;
- :class:`HybridActor` (:mod:`verl.trainer.api.hybrid_actor`): one actor that generates through the rollout engine and
  trains through the training engine, switched by the 3D-HybridEngine without reloading weights;
- the PPO trainer itself: ``verl.trainer.ppo.PPOTrainer(config)`` with ``rollout`` / ``update``, and
  ``verl.trainer.local_trainer.LocalPPOTrainer``.
"""

from verl.trainer.api.dataflow import DataFlow, DataFlowTrainer, TrainerConfig, register
from verl.trainer.api.hybrid_actor import HybridActor
from verl.trainer.api.pipeline import DataPipeline, RLTrainer, is_driver

__all__ = ["DataFlow", "DataFlowTrainer", "DataPipeline", "HybridActor", "RLTrainer", "TrainerConfig", "is_driver",
           "register"]
