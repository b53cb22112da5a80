"""Same-host CPU collectives through shared memory, underneath ``torch.distributed``.

Gloo pays about 2 ms per collective on a small host whatever the size (2 ranks: 16 KB and 880 KB alike,
against a 19 us TCP round trip), and Megatron's tensor (and sequence) parallelism runs two collectives per
layer in the forward and two more in the backward, so on CPU ranks a small TP model's step was mostly
waiting. ``verl._C.ShmCollectives`` runs them through one shared-memory region per group: each rank copies
its chunk into its slot, one rendezvous on per-rank counters, then every rank reads what it needs (a
reduction adds the slots in rank order, so every rank gets the same bits).

:func:`install` wraps ``all_reduce`` (SUM, MAX, MIN), ``all_gather`` (of equal tensors, as
``all_gather_object`` uses it), ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (SUM, MAX, MIN)
of ``torch.distributed``. A call on contiguous CPU tensors of a real dtype, on a gloo group whose ranks all
share this host, takes the shared-memory path: ``async_op=True`` gets a completed work, and inside a
``_coalescing_manager`` block the op runs at once (the block is left nothing to batch). Anything else --
other ops, devices or backends, groups that span hosts -- goes to torch unchanged. A group's region is set
up by its first eligible call (a collective of the group), its pages reserved at once (a ``/dev/shm`` too small
for it leaves the group on gloo instead of faulting later), and named only until every member opened it, so
nothing is left in ``/dev/shm`` even when a rank is killed. A rank waiting on a peer that exited raises at
once; one that waits past the process group's timeout raises too. ``VERL_SHM_COLLECTIVES=0`` leaves torch
alone.
"""

from __future__ import annotations

import os
import socket
import uuid

import torch
import torch.distributed as dist

SLOT_BYTES = 256 * 1024  # per rank and round; larger tensors go through in chunks
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
          torch.uint8)

_c10d = dist.distributed_c10d
_NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")
_TORCH = {name: getattr(_c10d, name) for name in _NAMES}
_installed = False
_timeout_s = 600.0
_groups: dict = {}  # ProcessGroup -> verl._C.ShmCollectives, or None where the fast path does not apply


class _CompletedWork:
    """What an ``async_op=True`` call returns: the collective already happened."""

    def __init__(self, *tensors: torch.Tensor):
        self._tensors = list(tensors)

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 -- torch's Work.wait signature
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list:
        return self._tensors


def enabled(environ=None) -> bool:
    return (os.environ if environ is None else environ).get("VERL_SHM_COLLECTIVES", "1").strip() != "0"


def install(timeout_s: float) -> None:
    """Route eligible collectives through shared memory (idempotent)."""
    global _installed, _timeout_s
    _timeout_s = float(timeout_s)
    _installed = True
    for name in _NAMES:
        setattr(dist, name, globals()[name])
        setattr(_c10d, name, globals()[name])


def uninstall() -> None:
    """Give torch its functions back and drop every group's region (before the groups are destroyed)."""
    global _installed
    _installed = False
    for name, fn in _TORCH.items():
        setattr(dist, name, fn)
        setattr(_c10d, name, fn)
    _groups.clear()


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``torch.distributed.all_reduce`` with the shared-memory path for what it covers."""
    name = _op_name(op)
    comm = _group_comm(group, tensor) if name is not None else None
    if comm is None:
        return _TORCH["all_reduce"](tensor, op=op, group=group, async_op=async_op)
    comm.all_reduce(tensor, name, _timeout_s)
    return _CompletedWork(tensor) if async_op else None


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """``torch.distributed.all_gather`` (a list of equal tensors: what ``all_gather_object`` runs twice per
    call, once for the sizes and once for the pickled bytes) with the shared-memory path."""
    same = isinstance(tensor_list, list | tuple) and all(
        isinstance(t, torch.Tensor) and t.shape == tensor.shape and t.dtype == tensor.dtype for t in tensor_list)
    comm = _group_comm(group, tensor, *tensor_list) if same else None
    if comm is None or len(tensor_list) != comm.world():
        return _TORCH["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
    flat = torch.empty((len(tensor_list), *tensor.shape), dtype=tensor.dtype)
    comm.all_gather(flat, tensor, _timeout_s)
    for out, row in zip(tensor_list, flat, strict=True):
        out.copy_(row)
    return _CompletedWork(*tensor_list) if async_op else None


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """``torch.distributed.all_gather_into_tensor`` with the shared-memory path for what it covers."""
    comm = _group_comm(group, output_tensor, input_tensor)
    if comm is None or output_tensor.dtype != input_tensor.dtype:
        return _TORCH["all_gather_into_tensor"](output_tensor, input_tensor, group=group, async_op=async_op)
    comm.all_gather(output_tensor, input_tensor, _timeout_s)
    return _CompletedWork(output_tensor) if async_op else None


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
    """``torch.distributed.reduce_scatter_tensor`` with the shared-memory path for what it covers."""
    name = _op_name(op)
    comm = _group_comm(group, output, input) if name is not None else None
    if comm is None or output.dtype != input.dtype:
        return _TORCH["reduce_scatter_tensor"](output, input, op=op, group=group, async_op=async_op)
    comm.reduce_scatter(output, input, name, _timeout_s)
    return _CompletedWork(output) if async_op else None


def uses_shared_memory(group=None) -> bool:
    """Whether ``group``'s collectives have taken the shared-memory path (known after its first eligible call)."""
    group = group if group is not None else _c10d._get_default_group()
    return _groups.get(group) is not None


def _op_name(op) -> str | None:
    for reduce_op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min")):
        if op == reduce_op:
            return name
    return None


def _group_comm(group, *tensors):
    """The group's region when this call can use it, else None (the call goes to torch)."""
    if not _installed:
        return None
    for t in tensors:
        if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype in DTYPES and t.is_contiguous()
                and t.numel() > 0):
            return None
    group = group if group is not None else _c10d._get_default_group()
    # A coalescing block (Megatron's DP grad reduce-scatter and param all-gather, one op per bucket) is no
    # reason to fall back: each op run at once gives the same result, and the block is left nothing to batch.
    if _c10d._rank_not_in_group(group):
        return None
    if group not in _groups:
        _groups[group] = None  # while it opens, its own object collectives go to torch
        _groups[group] = _open_group(group)
    return _groups[group]


def _open_group(group):
    """Collective over ``group``: every member opens one region, or all of them fall back to torch."""
    import verl._C as _C

    size = dist.get_world_size(group)
    if size < 2 or dist.get_backend(group) != "gloo":
        return None
    rank = dist.get_rank(group)
    proposal = (socket.gethostname(), f"/verl_shm_{os.getpid()}_{uuid.uuid4().hex[:12]}")
    members = [None] * size
    dist.all_gather_object(members, proposal, group=group)
    if len({host for host, _ in members}) != 1:
        return None
    name = members[0][1]

    def attempt(create: bool):
        """(region, None) or (None, why): every rank learns of a failure before anyone relies on the region."""
        try:
            return _C.ShmCollectives(name, rank, size, SLOT_BYTES, create), None
        except RuntimeError as err:
            return None, str(err)

    # Rank 0 creates, then the others open; each step's errors are shared before the next.
    comm, error = attempt(create=True) if rank == 0 else (None, None)
    created = [None] * size
    dist.all_gather_object(created, error, group=group)
    if created[0] is not None:
        return None
    if rank != 0:
        comm, error = attempt(create=False)
    opened = [None] * size
    dist.all_gather_object(opened, error, group=group)
    if rank == 0:
        comm.unlink()  # every member has it mapped (or gave up): the name is no longer needed
    return None if any(e is not None for e in opened) else comm
