"""Trainer configs: verl's packaged YAML defaults (``*.yaml`` here), one loader (:mod:`.loader`) and the PPO
trainer's checks (:mod:`.ppo`). ``--config-path=config`` from ``verl/trainer/main_ppo.py`` is this directory."""

from verl.trainer.config.loader import PACKAGED_CONFIG_DIR, ConfigError, resolve_path
from verl.trainer.config.ppo import load_config, use_critic, use_reference, world_size

__all__ = ["PACKAGED_CONFIG_DIR", "ConfigError", "load_config", "resolve_path", "use_critic", "use_reference",
           "world_size"]
