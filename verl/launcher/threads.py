"""The one thread policy of local ranks: how many intra-op threads a rank uses on a shared host.

Every way a rank starts (``verl train --nproc``, ``run_ranks``, ``verl sft``, ``verl generate``, Slurm,
mpirun, torchrun) asks :func:`intra_op_threads` once, so ranks that share a host's cores never
oversubscribe it, and a Slurm ``--cpus-per-task`` binding is respected.
"""

from __future__ import annotations

import os


def intra_op_threads(local_world_size: int, environ=None) -> int:
    """Intra-op threads for one of ``local_world_size`` ranks on this host: ``OMP_NUM_THREADS`` when
    set; else the cores this process may run on, split between the local ranks, unless a launcher
    already bound the process to fewer cores than the host has (Slurm's --cpus-per-task binding):
    then all of those."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"])
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if allowed < (os.cpu_count() or allowed):
        return max(1, allowed)
    return max(1, allowed // max(1, local_world_size))
