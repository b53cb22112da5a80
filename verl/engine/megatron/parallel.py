"""Megatron parallel state for a worker: model-parallel groups, CPU support, seeds.

torch.distributed must already be initialised (Slurm/mpirun bootstrap, or ``spawn.run_ranks``).
Megatron's ``parallel_state`` then owns every TP / PP / DP group.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from verl.engine.megatron.cpu_patches import apply_cpu_patches
from verl.errors import InputError


def initialize_megatron(tp_size: int = 1, pp_size: int = 1, seed: int = 1234, ep_size: int = 1,
                        etp_size: int | None = None) -> None:
    """Megatron's groups for (tp, pp) and, for MoE models, expert parallelism ``ep`` with expert tensor
    parallelism ``etp`` (None: megatron's default, tp) carved from each stage's tp*dp ranks."""
    from megatron.core import parallel_state as mpu

    if not dist.is_initialized():
        raise RuntimeError("initialize_megatron: expected torch.distributed to be initialised, found it is not")
    world = dist.get_world_size()
    if tp_size < 1 or pp_size < 1 or world % (tp_size * pp_size):
        raise InputError(f"tp*pp: expected a divisor of world size {world}, found tp={tp_size} pp={pp_size}")
    etp = tp_size if etp_size is None else etp_size
    if ep_size < 1 or etp < 1 or (world // pp_size) % (ep_size * etp):
        raise InputError(f"ep*etp: expected a divisor of the {world // pp_size} ranks of a pipeline stage, "
                         f"found ep={ep_size} etp={etp}")
    apply_cpu_patches()
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
                                  expert_model_parallel_size=ep_size, expert_tensor_parallel_size=etp)
    set_random_seed(seed)


def ensure_megatron(tp: int, pp: int, seed: int, ep: int = 1, etp: int | None = None) -> None:
    """Initialise Megatron's parallel state once per process (colocated roles share it)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
                mpu.get_expert_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size())
        want = (tp, pp, ep, tp if etp is None else etp)
        if have != want:
            raise InputError(f"megatron layout: expected (tp, pp, ep, etp) = {have} for every colocated role, "
                             f"found {want}")
        return
    initialize_megatron(tp, pp, seed=seed, ep_size=ep, etp_size=etp)


def set_random_seed(seed: int) -> None:
    """Megatron's convention: seed + 100 * pp_rank for every generator, then the TP RNG tracker."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def destroy_megatron() -> None:
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
