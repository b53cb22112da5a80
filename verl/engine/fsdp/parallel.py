"""The FSDP2 device mesh: every rank is a data-parallel rank; parameters are sharded within groups of
``fsdp_size`` ranks and replicated across them (HYBRID_SHARD) when ``fsdp_size`` < world size.

Global rank = replicate index * fsdp_size + shard index (``init_device_mesh`` numbers a 2-D mesh
row-major), the numbering :class:`verl.hybrid_engine.layouts.FSDPLayout` assumes. One mesh per process:
colocated roles (actor, reference, critic, reward model) share it, as Megatron roles share one parallel
state.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from verl.errors import InputError
from verl.launcher.bootstrap import on_teardown
from verl.utils.device import get_device_name

REPLICATE_DIM, SHARD_DIM = "ddp", "fsdp"  # verl's names for the two mesh dimensions

_MESH: FSDPMesh | None = None


@dataclasses.dataclass(frozen=True)
class FSDPMesh:
    mesh: object  # torch.distributed.device_mesh.DeviceMesh (1-D "fsdp", or 2-D ("ddp", "fsdp"))
    shard_size: int
    replicate_size: int

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size


def shard_size_for(fsdp_size: int | None, world_size: int) -> int:
    """verl's ``fsdp_config.fsdp_size``: -1 (or null, or >= the world) shards over every rank, else over
    groups of that many ranks, which must divide the world size."""
    if fsdp_size is None or fsdp_size == -1 or fsdp_size >= world_size:
        return world_size
    if fsdp_size < 1 or world_size % fsdp_size:
        raise InputError(f"fsdp_config.fsdp_size: expected -1 or a divisor of the world size {world_size}, "
                         f"found {fsdp_size}")
    return fsdp_size


def fsdp_mesh(fsdp_size: int | None = -1) -> FSDPMesh:
    """This process's mesh, made on the first call (a collective: every rank calls it together)."""
    global _MESH
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    shard = shard_size_for(fsdp_size, world)
    if _MESH is not None:
        if _MESH.shard_size != shard:
            raise InputError(f"fsdp_config.fsdp_size: expected {_MESH.shard_size} for every colocated role (one "
                             f"mesh per process), found {shard}")
        return _MESH
    if shard == world:
        mesh = init_device_mesh(get_device_name(), (world,), mesh_dim_names=(SHARD_DIM,))
    else:
        mesh = init_device_mesh(get_device_name(), (world // shard, shard), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
    _MESH = FSDPMesh(mesh, shard, world // shard)
    on_teardown(reset_fsdp_mesh)  # the mesh holds process groups: let it go before they are destroyed
    return _MESH


def reset_fsdp_mesh() -> None:
    """Forget the mesh (tests that tear the process group down and build another)."""
    global _MESH
    _MESH = None
