"""What a composed PPO config implies, each fact defined once: the world size, the backend's config rules, the actor's
(t, p) and DP size, the reshard's bucket bytes, and whether a critic and a reference policy run.

Each function reads the composed config as a mapping (the loader's dict or the trainer's ``DictConfig``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from verl.engine import strategies

if TYPE_CHECKING:
    from verl.engine.config_rules import BackendConfigRules

ARR = "actor_rollout_ref"
MIB = 2**20


def world_size(cfg: Mapping[str, Any]) -> int:
    return cfg["trainer"]["nnodes"] * cfg["trainer"]["n_gpus_per_node"]


def rollout_pool_size(cfg: Mapping[str, Any]) -> int:
    """Ranks of the standalone rollout pool (verl's ``rollout.nnodes x rollout.n_gpus_per_node``); 0: colocated."""
    rollout = cfg[ARR]["rollout"]
    return rollout["nnodes"] * rollout["n_gpus_per_node"] if rollout["nnodes"] else 0


def job_size(cfg: Mapping[str, Any]) -> int:
    """Every rank the job starts: the training ranks, then the rollout pool's."""
    return world_size(cfg) + rollout_pool_size(cfg)


def backend_rules(cfg: Mapping[str, Any]) -> BackendConfigRules:
    """The config rules of the backend the roles run on (every role follows the actor's strategy)."""
    return strategies.config_rules(cfg[ARR]["actor"]["strategy"])


def model_parallel_sizes(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """The actor's (tp, pp): Megatron's, or (1, 1) under FSDP (every rank is a DP rank)."""
    return backend_rules(cfg).model_parallel_sizes(cfg[ARR]["actor"])


def actor_dp_size(cfg: Mapping[str, Any], world: int | None = None) -> int:
    """How many ranks the actor's (and every colocated role's) batches are split over, in a world of ``world``
    ranks (None: the config's)."""
    tp, pp = model_parallel_sizes(cfg)
    return (world_size(cfg) if world is None else world) // (tp * pp)


def reshard_bucket_bytes(cfg: Mapping[str, Any]) -> int:
    """The 3D-HybridEngine's bucket: ``hybrid_engine.bucket_bytes``, or when that is null verl's
    ``rollout.checkpoint_engine.update_weights_bucket_megabytes`` MiB."""
    given = cfg["hybrid_engine"]["bucket_bytes"]
    return given if given is not None else \
        cfg[ARR]["rollout"]["checkpoint_engine"]["update_weights_bucket_megabytes"] * MIB


def use_critic(cfg: Mapping[str, Any]) -> bool:
    """verl: ``critic.enable``, or when that is null, a critic exactly when advantages come from GAE."""
    enable = cfg["critic"]["enable"]
    return cfg["algorithm"]["adv_estimator"] == "gae" if enable is None else bool(enable)


def use_reference(cfg: Mapping[str, Any]) -> bool:
    """verl: a reference policy exactly when the KL is in the reward or in the actor's loss."""
    return bool(cfg["algorithm"]["use_kl_in_reward"] or cfg[ARR]["actor"]["use_kl_loss"])
