"""``@register(dispatch_mode=...)``: how a worker method's arguments reach ranks and results come back.

Execution is SPMD: every rank runs the driver loop and holds the same arguments. A dispatch mode is
therefore two pure functions of the worker group's rank map (see :class:`DispatchInfo`):

- ``dispatch(info, rank, args, kwargs) -> (args, kwargs)``: what the worker on ``rank`` receives;
- ``collect(info, outputs) -> result``: the driver's result from the outputs of every pool rank
  (``outputs[i]`` is pool rank ``i``'s return value, or None where the rank was not a collect rank).

The worker group (:mod:`verl.single_controller.worker_group`) moves outputs between ranks; these
functions never communicate, so tests can drive them on a fake world.

Modes (verl's names):
  ONE_TO_ALL               same arguments on every pool rank; result: list of every rank's output
  ALL_TO_ALL               argument lists, element i to pool rank i; result: list per rank
  RANK_ZERO                same arguments everywhere; result: pool rank 0's output
  DP_COMPUTE_PROTO         DataProto split over the pool (each rank its own DP replica); concat
  MEGATRON_COMPUTE_PROTO   DataProto split over Megatron DP; every tp/pp rank of a replica gets its
                           share; concat of the outputs of (last pp stage, tp rank 0) in DP order
  make_nd_compute_dataproto_dispatch_fn(mesh_name)  the same over a worker-declared mesh
                           (e.g. "rollout": rollout DP replicas, collect from rollout tp rank 0)
DataProto arguments are padded to a multiple of the DP size and the padding is dropped from the
result (verl's auto-padding), so any batch size works.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any

from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

MAGIC_ATTR = "_verl_dispatch_spec"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    MEGATRON_COMPUTE_PROTO = "megatron_compute_proto"


@dataclasses.dataclass(frozen=True)
class MeshRank:
    """Where one pool rank sits in a DP mesh: its DP replica and whether its output is collected."""

    dp_rank: int
    dp_size: int
    is_collect: bool


@dataclasses.dataclass(frozen=True)
class DispatchInfo:
    """The rank map of a worker group, the same on every rank of the job.

    ``ranks``: global ranks of the pool, in pool order; ``meshes[name][i]``: pool rank i's place in
    mesh ``name`` ("dp" is the pool itself, one replica per rank).
    """

    ranks: tuple[int, ...]
    meshes: dict[str, tuple[MeshRank, ...]]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def mesh(self, name: str) -> tuple[MeshRank, ...]:
        if name not in self.meshes:
            raise KeyError(f"dispatch mesh {name!r}: expected one of {sorted(self.meshes)} (declared by the "
                           f"worker's dispatch_meshes()), found none")
        return self.meshes[name]


@dataclasses.dataclass(frozen=True)
class DispatchSpec:
    name: str
    dispatch: Callable[[DispatchInfo, int, tuple, dict], tuple[tuple, dict]]
    collect: Callable[[DispatchInfo, list[Any], Any], Any]
    prepare: Callable[[DispatchInfo, tuple, dict], tuple[tuple, dict, Any]]  # driver side, before dispatch
    collect_ranks: Callable[[DispatchInfo], list[bool]]
    mesh: str | None = None  # the DP mesh a DataProto is split over (None: not a DP-split mode)
    reads: tuple[str, ...] | None = None  # the batch fields the method reads (None: all): what the data plane moves
    # A generation call: the ranks meet at the group's GenerationWait (the rollout's deadline) before collecting.
    generation: bool = False


# --------------------------------------------------------------------------- simple modes
def _same(info, rank, args, kwargs):
    return args, kwargs


def _no_prepare(info, args, kwargs):
    return args, kwargs, None


def _all_ranks(info):
    return [True] * info.world_size


def _as_list(info, outputs, state):
    return list(outputs)


def _rank_zero(info, outputs, state):
    return outputs[0]


def _dispatch_all_to_all(info, rank, args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if not isinstance(value, (list, tuple)) or len(value) != info.world_size:
            raise ValueError(f"ALL_TO_ALL: expected every argument to be a list of {info.world_size} items "
                             f"(one per pool rank), found {type(value).__name__}"
                             f"{' of length ' + str(len(value)) if isinstance(value, (list, tuple)) else ''}")
    return tuple(a[rank] for a in args), {k: v[rank] for k, v in kwargs.items()}


# --------------------------------------------------------------------------- DataProto over a DP mesh
def _dp_size(info: DispatchInfo, mesh: str) -> int:
    sizes = {m.dp_size for m in info.mesh(mesh)}
    if len(sizes) != 1:
        raise ValueError(f"dispatch mesh {mesh!r}: expected one DP size on every rank, found {sorted(sizes)}")
    return sizes.pop()


def _prepare_proto(mesh: str):
    def prepare(info, args, kwargs):
        dp = _dp_size(info, mesh)
        pad_sizes = set()

        def pad(value):
            if isinstance(value, DataProto):
                padded, pad_size = pad_dataproto_to_divisor(value, dp)
                pad_sizes.add((len(value), pad_size))
                return padded
            return value

        args = tuple(pad(a) for a in args)
        kwargs = {k: pad(v) for k, v in kwargs.items()}
        if len(pad_sizes) > 1:
            raise ValueError(f"{mesh} dispatch: expected DataProto arguments of one batch size, found "
                             f"{sorted(s for s, _ in pad_sizes)}")
        return args, kwargs, (next(iter(pad_sizes)) if pad_sizes else None)

    return prepare


def _dispatch_proto(mesh: str):
    def dispatch(info, rank, args, kwargs):
        me = info.mesh(mesh)[rank]

        def share(value):
            return value.chunk(me.dp_size)[me.dp_rank] if isinstance(value, DataProto) else value

        return tuple(share(a) for a in args), {k: share(v) for k, v in kwargs.items()}

    return dispatch


def _collect_ranks(mesh: str):
    def collect_ranks(info):
        return [m.is_collect for m in info.mesh(mesh)]

    return collect_ranks


def _collect_proto(mesh: str):
    def collect(info, outputs, state):
        by_dp: dict[int, Any] = {}
        for m, out in zip(info.mesh(mesh), outputs, strict=False):
            if m.is_collect:
                if m.dp_rank in by_dp:
                    raise ValueError(f"{mesh} collect: expected one collect rank per DP replica, found two for "
                                     f"replica {m.dp_rank}")
                by_dp[m.dp_rank] = out
        dp = _dp_size(info, mesh)
        if sorted(by_dp) != list(range(dp)):
            raise ValueError(f"{mesh} collect: expected outputs of DP replicas 0..{dp - 1}, found {sorted(by_dp)}")
        parts = [by_dp[i] for i in range(dp)]
        if all(p is None for p in parts):
            return None
        if not all(isinstance(p, DataProto) for p in parts):
            return parts
        merged = DataProto.concat(parts)
        if state is not None:
            original, pad_size = state
            # A method may return n rows per input row (generation): drop n rows per padded row.
            rows_per_input = len(merged) // (original + pad_size)
            merged = unpad_dataproto(merged, pad_size * rows_per_input)
        return merged

    return collect


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> DispatchSpec:
    """DataProto split over the DP replicas of the worker's mesh ``mesh_name``; collect per replica."""
    return DispatchSpec(f"nd_compute_proto[{mesh_name}]", _dispatch_proto(mesh_name), _collect_proto(mesh_name),
                        _prepare_proto(mesh_name), _collect_ranks(mesh_name), mesh_name)


PREDEFINED: dict[Dispatch, DispatchSpec] = {
    Dispatch.ONE_TO_ALL: DispatchSpec("one_to_all", _same, _as_list, _no_prepare, _all_ranks),
    Dispatch.ALL_TO_ALL: DispatchSpec("all_to_all", _dispatch_all_to_all, _as_list, _no_prepare, _all_ranks),
    Dispatch.RANK_ZERO: DispatchSpec("rank_zero", _same, _rank_zero, _no_prepare,
                                     lambda info: [i == 0 for i in range(info.world_size)]),
    Dispatch.DP_COMPUTE_PROTO: dataclasses.replace(make_nd_compute_dataproto_dispatch_fn("dp"),
                                                   name="dp_compute_proto"),
    Dispatch.MEGATRON_COMPUTE_PROTO: dataclasses.replace(make_nd_compute_dataproto_dispatch_fn("megatron"),
                                                         name="megatron_compute_proto"),
}


def get_dispatch_spec(mode: Dispatch | DispatchSpec) -> DispatchSpec:
    if isinstance(mode, DispatchSpec):
        return mode
    if mode not in PREDEFINED:
        raise ValueError(f"dispatch_mode: expected a Dispatch member or a DispatchSpec, found {mode!r}")
    return PREDEFINED[mode]


def register(dispatch_mode: Dispatch | DispatchSpec = Dispatch.ALL_TO_ALL,
             reads: Sequence[str] | None = None, generation: bool = False) -> Callable:
    """Mark a worker method as callable through its worker group with ``dispatch_mode``. ``reads``: the batch
    fields it reads (those present travel on the data plane; the legacy path passes the whole batch).
    ``generation``: it runs the rollout, whose wait is bounded by the rollout's deadline
    (:mod:`verl.single_controller.generation_wait`), not the collective timeout."""
    spec = get_dispatch_spec(dispatch_mode)
    if reads is not None:
        spec = dataclasses.replace(spec, reads=tuple(reads))
    if generation:
        spec = dataclasses.replace(spec, generation=True)

    def decorator(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)

        setattr(inner, MAGIC_ATTR, spec)
        return inner

    return decorator


def registered_methods(cls: type) -> dict[str, DispatchSpec]:
    """Every ``@register``-ed method of ``cls`` (inherited ones included) -> its dispatch spec."""
    out = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), MAGIC_ATTR, None)
        if spec is not None:
            out[name] = spec
    return out


def run_on_fake_world(info: DispatchInfo, spec: DispatchSpec, method: Callable[[int, tuple, dict], Any],
                      args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
    """Dispatch, call ``method(pool_rank, args, kwargs)`` for every pool rank in turn, collect.

    The single-process model of what the worker group does across processes (tests, debugging).
    """
    args, kwargs, state = spec.prepare(info, tuple(args), dict(kwargs or {}))
    collected = spec.collect_ranks(info)
    outputs = []
    for rank in range(info.world_size):
        rank_args, rank_kwargs = spec.dispatch(info, rank, args, kwargs)
        out = method(rank, rank_args, rank_kwargs)
        outputs.append(out if collected[rank] else None)
    return spec.collect(info, outputs, state)
