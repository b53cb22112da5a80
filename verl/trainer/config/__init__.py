"""Trainer configs: verl's packaged YAML defaults (``*.yaml`` here), one loader (:mod:`.loader`), the PPO
trainer's checks (:mod:`.ppo`) and what a composed config implies (:mod:`.derived`). ``--config-path=config``
from ``verl/trainer/main_ppo.py`` is this directory."""

from verl.trainer.config.derived import actor_dp_size, job_size, use_critic, use_reference, world_size
from verl.trainer.config.loader import PACKAGED_CONFIG_DIR, ConfigError, resolve_path
from verl.trainer.config.ppo import load_config

__all__ = ["PACKAGED_CONFIG_DIR", "ConfigError", "actor_dp_size", "job_size", "load_config", "resolve_path",
           "use_critic", "use_reference", "world_size"]
