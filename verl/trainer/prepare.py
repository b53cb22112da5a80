"""What ``main_ppo`` does before it builds the trainer, for a trainer built in this process (the Python API,
:class:`~verl.trainer.local_trainer.LocalPPOTrainer`, ``PPOTrainer(config)`` without a tokenizer):

- :func:`resolve_config`: a config as a dict, an OmegaConf config or a YAML path, with verl's keys, loaded over the
  packaged defaults and validated by ``load_config`` (the same checks as `verl train`; bad input: one
  :class:`~verl.errors.InputError`);
- :func:`ensure_distributed`: torch.distributed as `verl train`'s rank would have it (``init_distributed``: seeded with
  ``trainer.seed``, the config's timeout); under srun/torchrun/mpirun this process is the launcher's rank, otherwise
  it is a world of one (gloo on CPU). A process group that already exists is used as it is.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from verl.errors import InputError


def resolve_config(config: Any, overrides: Sequence[str] = (), data_pending: bool = False) -> Any:
    """``config`` (a mapping, an OmegaConf config, or the path of a YAML file) merged over the packaged defaults
    with ``overrides`` (``key=value``, as on `verl train`'s command line), validated; an OmegaConf DictConfig.
    ``data_pending``: no data files are read (a role built without the trainer, e.g. the API's HybridActor)."""
    from omegaconf import DictConfig, OmegaConf

    from verl.trainer.config import ConfigError, load_config

    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise InputError(f"config: expected a YAML file, found no file at {path}")
        try:
            return load_config(path, list(overrides), data_pending=data_pending)
        except ConfigError as err:
            raise InputError(f"config error: {err}") from None
    if isinstance(config, DictConfig):
        tree = OmegaConf.to_container(config, resolve=True)
    elif isinstance(config, Mapping):
        tree = dict(config)
    elif config is None:
        tree = {}
    else:
        raise InputError(f"config: expected a dict, an OmegaConf config or a YAML path, found {type(config).__name__}")
    # load_config reads a user file (its relative paths resolve against the working directory): one written here.
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="verl_config_", delete=False) as fh:
        OmegaConf.save(OmegaConf.create(tree), fh)
        path = fh.name
    try:
        return load_config(path, list(overrides), data_pending=data_pending)
    except ConfigError as err:
        raise InputError(f"config error: {err}") from None
    finally:
        os.unlink(path)


def ensure_distributed(config: Any) -> bool:
    """torch.distributed initialised as `verl train`'s rank initialises it (a world of one outside a launcher);
    returns whether this call initialised it (then :func:`verl.launcher.bootstrap.destroy_distributed` ends it, at
    the latest when the interpreter exits)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    from verl.launcher.bootstrap import init_distributed
    from verl.launcher.env import discover

    env = discover()
    world = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    if env.source == "local" and world != 1:
        raise InputError(f"trainer.nnodes * trainer.n_gpus_per_node={world}: expected 1 in one process outside a "
                         "launcher (start the script under srun/torchrun/mpirun, or use `verl train` for local ranks)")
    init_distributed(seed=config.trainer.seed, timeout_s=float(config.actor_rollout_ref.nccl_timeout))
    # A user's script ends with the interpreter's exit, not with `verl train`'s teardown: a gloo group left for
    # the interpreter's shutdown aborts the process now and then ("terminate called without an active
    # exception", seen on CI under torchrun), so the group this call started ends before that.
    import atexit

    from verl.launcher.bootstrap import destroy_distributed

    atexit.register(destroy_distributed)
    return True


def load_tokenizer(config: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.data.tokenizer)


def prepare(config: Any, overrides: Sequence[str] = ()) -> tuple[Any, Any, bool]:
    """(the validated config, its tokenizer, whether this call started torch.distributed): what ``main_ppo`` does
    before it builds the trainer."""
    config = resolve_config(config, overrides)
    owns = ensure_distributed(config)
    return config, load_tokenizer(config), owns
