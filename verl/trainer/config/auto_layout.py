"""``VERL_DEVICE_MAP=multi`` (the documents' switch) for ``verl train``: when neither the ``--config`` file nor the
overrides name a parallel layout, one is chosen from the model's size, the ranks and the memory per device
(:mod:`verl.models.layout_choice`, as the Python API does for a config that names none) and appended to the
overrides; a layout the user names always wins. Without the variable ``verl train`` keeps the packaged defaults.

``VERL_DEVICE_MEMORY_GIB`` plans for a device of that size instead of this machine's (a larger GPU than the one
at hand; the tests' simulated memory).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from verl.errors import InputError

DEVICE_MAP_ENV = "VERL_DEVICE_MAP"
DEVICE_MEMORY_ENV = "VERL_DEVICE_MEMORY_GIB"
_HALF_PRECISION = ("bfloat16", "bf16", "float16", "fp16")


def requested(environ: os._Environ | dict | None = None) -> bool:
    """Whether the user asked for the layout to be chosen (``VERL_DEVICE_MAP=multi``; other values: not)."""
    env = os.environ if environ is None else environ
    return env.get(DEVICE_MAP_ENV, "").strip().lower() == "multi"


def _device_memory() -> int | None:
    from verl.models.memory import GiB

    raw = os.environ.get(DEVICE_MEMORY_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise InputError(f"{DEVICE_MEMORY_ENV}: expected a positive number of GiB, found {raw!r}")
    return int(gib * GiB)


def chosen_overrides(path: str | None, overrides: Sequence[str], launcher_world_size: int | None,
                     config_dir: str, config_name: str | None) -> tuple[list[str], str]:
    """(the chosen layout as ``key=value`` overrides, the block to print). Nothing is chosen when the user's file
    or overrides name a layout key: ([], a line saying so)."""
    from verl.models.config import ModelConfig
    from verl.models.layout_choice import choose_layout, flatten, names_layout
    from verl.trainer.config.derived import world_size
    from verl.trainer.config.loader import read_user_file
    from verl.trainer.config.ppo import load_config

    keys = flatten(read_user_file(path)) if path else {}
    keys.update({item.split("=", 1)[0].lstrip("+~"): None for item in overrides})
    named = names_layout(keys)
    if named:
        return [], f"[layout] {DEVICE_MAP_ENV}=multi: the layout you named wins ({', '.join(named)})"
    # The composed config (types and ranges only) for the model, the ranks and the dtype.
    cfg = load_config(path, overrides, launcher_world_size=launcher_world_size, config_dir=config_dir,
                      config_name=config_name, resolve_only=True)
    world = launcher_world_size or world_size(cfg)
    actor = cfg.actor_rollout_ref.actor
    dtype = str(actor.megatron.get("dtype") or actor.fsdp_config.get("model_dtype") or "float32")
    memory = _device_memory()
    accelerator = None
    if memory is not None:
        from verl.utils.device import is_cuda_available

        accelerator = is_cuda_available()
    choice = choose_layout(ModelConfig.from_pretrained(cfg.actor_rollout_ref.model.path), world,
                           ranks_per_node=min(world, int(cfg.trainer.n_gpus_per_node)), device_memory=memory,
                           accelerator=accelerator, dtype_bytes=2 if dtype in _HALF_PRECISION else 4)
    return [f"{key}={value}" for key, value in choice.overrides.items()], choice.describe()
