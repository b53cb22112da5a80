"""Two resource pools in one job: the training pool and a standalone rollout pool, joined by a bridge group.

verl's keys place them: ``trainer.nnodes x trainer.n_gpus_per_node`` training ranks, then
``actor_rollout_ref.rollout.nnodes x rollout.n_gpus_per_node`` rollout ranks (``rollout.nnodes = 0``: the
rollout is colocated, no pools). The launcher starts all of them as one job (job ranks ``[0, N_t)`` train,
``[N_t, N_t + N_r)`` generate). Each pool is its own torch.distributed world (its default process group:
Megatron's, FSDP's and the rollout engine's groups live inside one pool and never see the other), and
the :class:`Bridge` spans both: a process group over every job rank, built from the same rendezvous
store under its own prefix, which carries the cross-pool weight transfer and the controller's commands
to the rollout pool (:mod:`verl.workers.rollout_pool`).
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle
from typing import Any

import torch

from verl.errors import InputError

OBJECT_TAG = 1  # the controller's commands and the rollout pool's replies; weight buckets use their own tags
POOL_TRAINING, POOL_ROLLOUT = "training", "rollout"


@dataclasses.dataclass(frozen=True)
class PoolSplit:
    """How many job ranks each pool has (training first)."""

    n_training: int
    n_rollout: int

    @property
    def world_size(self) -> int:
        return self.n_training + self.n_rollout

    def pool_of(self, job_rank: int) -> tuple[str, int, int]:
        """(pool name, rank inside the pool, pool size) of a job rank."""
        if job_rank < self.n_training:
            return POOL_TRAINING, job_rank, self.n_training
        return POOL_ROLLOUT, job_rank - self.n_training, self.n_rollout


def split_from_config(config: Any) -> PoolSplit | None:
    """The pools verl's keys ask for, or None for a colocated rollout. Sizes are checked by the config
    loader (:func:`verl.trainer.config.ppo`) before any rank starts."""
    rollout = config.actor_rollout_ref.rollout
    if not int(rollout.get("nnodes", 0) or 0):
        return None
    trainer = config.trainer
    return PoolSplit(int(trainer.nnodes) * int(trainer.n_gpus_per_node),
                     int(rollout.nnodes) * int(rollout.n_gpus_per_node))


class Bridge:
    """Point-to-point over process groups spanning both pools (bridge rank = job rank): ``group`` carries weight
    buckets (NCCL between GPUs, else gloo), ``control`` (gloo, CPU tensors) the small messages: commands,
    rollouts, bucket headers. On CPU both are one gloo group."""

    def __init__(self, group: Any, rank: int, size: int, split: PoolSplit | None = None, control: Any = None,
                 results: Any = None):
        self.group, self.rank, self.size, self.split = group, rank, size, split
        self.control = group if control is None else control
        # Streamed rollouts (the asynchronous trainer): pool -> training rank 0 on a group of their own, so the
        # receiving thread there never shares a group with the commands and weights of the main thread.
        self.results = self.control if results is None else results

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        return self.group.send([tensor], dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int):
        return self.group.recv([tensor], src, tag)

    def isend_control(self, tensor: torch.Tensor, dst: int, tag: int):
        return self.control.send([tensor], dst, tag)

    def irecv_control(self, tensor: torch.Tensor, src: int, tag: int):
        return self.control.recv([tensor], src, tag)

    def send_object(self, obj: Any, dst: int) -> None:
        _send_object(self.control, obj, dst)

    def recv_object(self, src: int, timeout: datetime.timedelta | None = None) -> Any:
        """The next object ``src`` sends; ``timeout`` (default: the group's) bounds the wait for it to start."""
        return _recv_object(self.control, src, timeout)

    def send_result(self, obj: Any, dst: int) -> None:
        """On the results group (see ``results``); gloo's send returns once ``dst`` posted its receive."""
        _send_object(self.results, obj, dst)

    def recv_result(self, src: int, timeout: datetime.timedelta | None = None) -> Any:
        return _recv_object(self.results, src, timeout)


def _send_object(group: Any, obj: Any, dst: int) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, OBJECT_TAG).wait()
    if data.numel():
        group.send([data], dst, OBJECT_TAG).wait()


def _recv_object(group: Any, src: int, timeout: datetime.timedelta | None) -> Any:
    size = torch.empty(1, dtype=torch.int64)
    work = group.recv([size], src, OBJECT_TAG)
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
    data = torch.empty(int(size), dtype=torch.uint8)
    if data.numel():
        group.recv([data], src, OBJECT_TAG).wait()
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 - peers of this job only (bridge ranks)


_BRIDGE: Bridge | None = None


def current_bridge() -> Bridge:
    if _BRIDGE is None:
        raise RuntimeError("bridge: expected the job to run with a standalone rollout pool "
                           "(init_distributed(pools=...)), found none")
    return _BRIDGE


def make_bridge(store: Any, rank: int, size: int, backend: str, timeout: datetime.timedelta,
                split: PoolSplit | None = None) -> Bridge:
    """The bridge group over every job rank, on ``store`` under its own prefix (every rank calls it)."""
    global _BRIDGE
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise InputError(f"bridge backend: expected 'gloo' or 'nccl', found {backend!r}")
    control = dist.ProcessGroupGloo(dist.PrefixStore("verl_bridge", store), rank, size, timeout)
    results = dist.ProcessGroupGloo(dist.PrefixStore("verl_bridge_results", store), rank, size, timeout)
    group = None
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore("verl_bridge_nccl", store), rank, size, options)
    _BRIDGE = Bridge(group or control, rank, size, split, control=control, results=results)
    return _BRIDGE


def drop_bridge() -> None:
    global _BRIDGE
    _BRIDGE = None
