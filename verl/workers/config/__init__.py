"""Typed config sections (verl's ``verl/workers/config``): each role's part of the composed YAML as a frozen
dataclass whose fields carry their types and rules (:mod:`.section`). The trainer builds them once from the
loaded config; each worker receives its own."""

from verl.workers.config.actor import ActorConfig, ActorRolloutRefConfig, RefConfig
from verl.workers.config.critic import CriticConfig
from verl.workers.config.reward_model import RewardModelConfig
from verl.workers.config.rollout import RolloutConfig
from verl.workers.config.section import Section

__all__ = ["ActorConfig", "ActorRolloutRefConfig", "CriticConfig", "RefConfig", "RewardModelConfig",
           "RolloutConfig", "Section"]
