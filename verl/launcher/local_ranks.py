"""Run a function on N local ranks (one process each, gloo over loopback) and collect its results.

Used by the entry points that spawn the ranks they need (convert, generate, sft, bench reshard) and
by the multi-rank tests. Rendezvous is a ``file://`` store in a fresh temp dir (no TCP listener). The first rank to
fail, or the timeout, ends every rank: nothing waits forever on a collective a dead rank will never
join.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A spawned rank raised, died, or the ranks ran past their time limit."""


def _rank_main(fn, rank, world_size, init_file, threads, results, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        # Bytes, not tensors: torch's shared-memory handles die with a rank that already exited.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which ends every rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
              threads_per_rank: int = 1) -> List[Any]:
    """``fn(*args)`` on ``world_size`` ranks with torch.distributed initialised; returns per-rank values.

    ``fn`` must be importable (module level); it returns tensors, numbers, strings, lists and dicts
    (what ``torch.load(weights_only=True)`` accepts).
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected a positive integer, found {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="verl_ranks_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # Not daemonic: dist_checkpointing's saver starts a child process of its own.
        procs = [ctx.Process(target=_rank_main,
                             args=(fn, rank, world_size, init_file, threads_per_rank, results, args))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        values: dict = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(values) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RankFailure(f"ranks: expected {world_size} results within {timeout_s:.0f}s, "
                                      f"found {len(values)} (ranks {sorted(values)})")
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                    if dead:
                        raise RankFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                    continue
                if not ok:
                    raise RankFailure(f"rank {rank} failed:\n{value}")
                values[rank] = torch.load(io.BytesIO(value), weights_only=True)
        finally:
            for proc in procs:
                proc.join(timeout=5 if len(values) == world_size else 0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return [values[r] for r in range(world_size)]


def _call_with_rank(fn, *args):
    import torch.distributed as dist

    return fn(dist.get_rank(), dist.get_world_size(), *args)


def run_ranks_with_rank(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
                        threads_per_rank: int = 1) -> List[Any]:
    """Like :func:`run_ranks`, calling ``fn(rank, world_size, *args)``."""
    return run_ranks(_call_with_rank, world_size, fn, *args, timeout_s=timeout_s, threads_per_rank=threads_per_rank)
