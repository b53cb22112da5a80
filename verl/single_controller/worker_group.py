"""WorkerGroup: one role placed on a resource pool, its ``@register``-ed methods callable from the
SPMD driver loop.

Every rank of the job runs the driver loop and constructs every worker group; the worker itself
exists only on the ranks of its pool. Calling ``group.method(data)`` on every rank:

1. the dispatch spec pads the arguments (DataProto to a multiple of the DP size);
2. each pool rank runs the method on its share;
3. the outputs of the collect ranks travel to **every** rank of the job (an object all-gather over
   torch.distributed; a DataProto travels as ``DataProto.to_bytes``), so the next worker group, on
   the same or another rank set, receives the same full result;
4. the spec merges them (and drops the padding).

With colocated groups (the default, the hybrid engine) every pool is the whole job. World size 1
needs no process group at all.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist

from verl.protocol import DataProto, strict_data_check_enabled
from verl.single_controller.data_plane import (
    STATS,
    ShardedBatch,
    batch_from_outputs,
    dispatch_positions,
    object_group,
)
from verl.single_controller.decorator import DispatchInfo, DispatchSpec, MeshRank, registered_methods
from verl.single_controller.generation_wait import GenerationWait
from verl.single_controller.worker import Worker

_PROTO_TAG = "verl.DataProto"


@dataclasses.dataclass(frozen=True)
class ResourcePool:
    """The global ranks a worker group runs on; ``None`` ranks means every rank of the job."""

    ranks: tuple[int, ...] | None = None

    def resolve(self, world_size: int) -> tuple[int, ...]:
        if self.ranks is None:
            return tuple(range(world_size))
        ranks = tuple(self.ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world_size for r in ranks):
            raise ValueError(f"resource pool: expected distinct ranks in [0, {world_size}), found {list(ranks)}")
        return ranks


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank; DataProto travels as bytes."""
    rank, world = _world()
    if world == 1:
        return [obj]
    payload = (_PROTO_TAG, obj.to_bytes()) if isinstance(obj, DataProto) else obj
    gathered: list[Any] = [None] * world
    start = time.perf_counter()
    dist.all_gather_object(gathered, payload, group=object_group())
    # What the legacy path moves: every other rank's output, to every rank (the bench's baseline).
    STATS.object_bytes += sum(len(p[1]) if isinstance(p, tuple) and len(p) == 2 and p[0] == _PROTO_TAG else 0
                              for i, p in enumerate(gathered) if i != rank)
    STATS.seconds += time.perf_counter() - start
    return [DataProto.from_bytes(p[1]) if isinstance(p, tuple) and len(p) == 2 and p[0] == _PROTO_TAG else p
            for p in gathered]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    rank, world = _world()
    if world == 1:
        return obj
    box = [obj if rank == src else None]
    dist.broadcast_object_list(box, src=src, group=object_group())
    return box[0]


class WorkerGroup:
    """``worker_cls(*args, **kwargs)`` on the ranks of ``pool``; registered methods become methods here."""

    def __init__(self, worker_cls: type, *args: Any, pool: ResourcePool | None = None,
                 name: str | None = None, generation_wait: GenerationWait | None = None, **kwargs: Any):
        """``generation_wait``: where the ranks meet after a ``@register(generation=True)`` call (the rollout's
        deadline); without it they meet in the collect's collective (the collective timeout)."""
        if not issubclass(worker_cls, Worker):
            raise TypeError(f"WorkerGroup: expected a Worker subclass, found {worker_cls.__name__}")
        self.generation_wait = generation_wait
        self.name = name or worker_cls.__name__
        self.rank, world = _world()
        self.pool_ranks = (pool or ResourcePool()).resolve(world)
        self.worker: Worker | None = worker_cls(*args, **kwargs) if self.rank in self.pool_ranks else None
        self.info = self._exchange_rank_map()
        for method_name, spec in registered_methods(worker_cls).items():
            setattr(self, method_name, self._bind(method_name, spec))

    @property
    def world_size(self) -> int:
        return len(self.pool_ranks)

    def _exchange_rank_map(self) -> DispatchInfo:
        local = None
        if self.worker is not None:
            local = dict(self.worker.dispatch_meshes())
            pool_rank = self.pool_ranks.index(self.rank)
            local["dp"] = MeshRank(pool_rank, len(self.pool_ranks), True)
        per_rank = all_gather_objects(local)
        maps = [per_rank[r] for r in self.pool_ranks]
        names = set(maps[0])
        if any(set(m) != names for m in maps):
            raise ValueError(f"{self.name}: expected every pool rank to declare the same dispatch meshes, "
                             f"found {[sorted(m) for m in maps]}")
        return DispatchInfo(self.pool_ranks, {n: tuple(m[n] for m in maps) for n in sorted(names)})

    def _bind(self, method_name: str, spec: DispatchSpec) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self.execute(method_name, spec, args, kwargs)

        call.__name__ = method_name
        return call

    def execute(self, method_name: str, spec: DispatchSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if any(isinstance(v, ShardedBatch) for v in (*args, *kwargs.values())):
            return self._execute_sharded(method_name, spec, tuple(args), dict(kwargs))
        args, kwargs, state = spec.prepare(self.info, tuple(args), dict(kwargs))
        output = None
        if self.worker is not None:
            pool_rank = self.pool_ranks.index(self.rank)
            rank_args, rank_kwargs = spec.dispatch(self.info, pool_rank, args, kwargs)
            for value in (*rank_args, *rank_kwargs.values()):
                _count_shard(value, spec.reads)
            output = getattr(self.worker, method_name)(*rank_args, **rank_kwargs)
            if isinstance(output, DataProto) and strict_data_check_enabled():
                output.check_consistency(producer=f"{self.name}.{method_name}")
            if not spec.collect_ranks(self.info)[pool_rank]:
                output = None
        if spec.generation and self.generation_wait is not None:
            self.generation_wait.wait(f"{self.name}.{method_name}")
        gathered = all_gather_objects(output)
        return spec.collect(self.info, [gathered[r] for r in self.pool_ranks], state)

    def _execute_sharded(self, method_name: str, spec: DispatchSpec, args: tuple, kwargs: dict) -> ShardedBatch:
        """The data plane's call: each rank of DP replica d receives replica d's rows (each field from the rank
        holding it); the outputs stay on their collect ranks, and the result is a :class:`ShardedBatch`."""
        if spec.mesh is None:
            raise ValueError(f"{self.name}.{method_name}: a ShardedBatch argument needs a DP-split dispatch mode, "
                             f"found {spec.name}")
        batches = [v for v in (*args, *kwargs.values()) if isinstance(v, ShardedBatch)]
        if len(batches) != 1:
            raise ValueError(f"{self.name}.{method_name}: expected one ShardedBatch argument, found {len(batches)}")
        batch = batches[0]
        mesh = self.info.mesh(spec.mesh)
        dp = mesh[0].dp_size
        shares, pad = dispatch_positions(len(batch), dp)
        replica_of = {self.pool_ranks[i]: place.dp_rank for i, place in enumerate(mesh)}
        nothing = shares[0][:0]
        fields = None if spec.reads is None else [f for f in spec.reads if f in batch.fields]
        local = batch.gather(lambda r: shares[replica_of[r]] if r in replica_of else nothing, fields)
        output = None
        if self.worker is not None:
            pool_rank = self.pool_ranks.index(self.rank)
            _count_shard(local, spec.reads)
            rank_args = tuple(local if isinstance(a, ShardedBatch) else a for a in args)
            rank_kwargs = {k: local if isinstance(v, ShardedBatch) else v for k, v in kwargs.items()}
            output = getattr(self.worker, method_name)(*rank_args, **rank_kwargs)
            if not mesh[pool_rank].is_collect:
                output = None
            elif not isinstance(output, DataProto):
                raise ValueError(f"{self.name}.{method_name}: expected a DataProto from a data-plane call, found "
                                 f"{type(output).__name__}")
        if spec.generation and self.generation_wait is not None:
            self.generation_wait.wait(f"{self.name}.{method_name}")
        holders = [None] * dp
        for pool_rank, place in enumerate(mesh):
            if place.is_collect:
                holders[place.dp_rank] = self.pool_ranks[pool_rank]
        return batch_from_outputs(holders, output, len(shares[0]), pad, batch.row_ids[np.concatenate(shares)])


def _count_shard(data: Any, reads: tuple[str, ...] | None) -> None:
    """What a worker consumes: the tensor bytes of the fields it reads (``reads``; None: all, and then the
    per-row objects too, pickled) of its DataProto arguments: the bench's shard_bytes_per_rank."""
    if not isinstance(data, DataProto):
        return
    if data.batch is not None:
        STATS.shard_bytes += sum(v.numel() * v.element_size() for k, v in data.batch.items()
                                 if reads is None or k in reads)
    if data.non_tensor_batch and reads is None:
        import pickle

        STATS.shard_bytes += len(pickle.dumps(list(data.non_tensor_batch.values()), protocol=pickle.HIGHEST_PROTOCOL))
