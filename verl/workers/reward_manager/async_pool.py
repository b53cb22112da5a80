"""Rewards off the critical path: verl's ``reward.num_workers`` (and the legacy
``reward_model.launch_reward_fn_async``, one worker).

A :class:`RewardPool` holds ``num_workers`` spawned processes, each with its own copy of the trainer's reward
manager (pickled once when the pool starts: the tokenizer, and the scorer as a built-in or as the user file's
path and name, which the process loads again). :meth:`RewardPool.submit` splits a batch's rows into contiguous
chunks, one per process, and returns at once; the step runs its old-log-prob, reference and value passes and
calls :meth:`PendingRewards.result` before the advantage. A slow Python scorer runs in other processes, so it
holds neither this rank's GIL nor its cores' torch threads (each process runs torch with one thread).

Every sample is scored by the same manager code as the synchronous path, so the scores and
``reward_extra_info`` are the same. A score that raises fails the step with one line naming the exception, the
sample's row in the step's batch and its data source; the user's traceback is attached as a note.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import numpy as np
import torch

from verl.errors import InputError
from verl.protocol import DataProto

_MANAGER: Callable | None = None  # a worker process's reward manager (set by _init_worker)


class RewardScoreError(RuntimeError):
    """A reward function that raised in a reward worker process (an internal error of the user's code: exit 1)."""


class RewardScoreInputError(RewardScoreError, InputError):
    """The same, where the reward function raised a :class:`verl.errors.InputError` (exit 2, as in-process)."""


def _init_worker(manager_blob: bytes, parent_pid: int) -> None:
    global _MANAGER
    from verl.launcher.spawn import die_with_parent

    # Gone with the rank, even a SIGKILLed one: an orphaned worker would wait on its queue forever, a process
    # left behind on the node (Slurm's job end does not reach a process reparented away from the step).
    die_with_parent(parent_pid)
    # One torch thread: the pool's processes share the rank's cores with its training threads.
    torch.set_num_threads(1)
    _MANAGER = pickle.loads(manager_blob)


def _ready() -> bool:
    return _MANAGER is not None


def _score(batch: dict[str, torch.Tensor], non_tensor: dict[str, np.ndarray]) -> dict[str, Any]:
    """One chunk's ``{"reward_tensor", "reward_extra_info"}``, or ``{"error": ...}`` describing what raised (the
    exception itself may be of a class only this process can import: the user's file)."""
    try:
        out = _MANAGER(DataProto.from_dict(batch, non_tensor), return_dict=True)
    except Exception as err:
        return {"error": {"type": type(err).__name__, "message": str(err), "input_error": isinstance(err, InputError),
                          "sample": getattr(err, "reward_sample", None), "traceback": traceback.format_exc()}}
    return {"reward_tensor": out["reward_tensor"].cpu(), "reward_extra_info": dict(out["reward_extra_info"])}


class PendingRewards:
    """The rewards of one submitted batch, being computed; :meth:`result` waits for them."""

    def __init__(self, futures: list[tuple[int, Future]], positions: Sequence[int] | None, device: torch.device):
        self._futures, self._positions, self._device = futures, positions, device

    def result(self, return_dict: bool = False):
        """``reward_tensor`` [rows, R] of the submitted rows (with ``return_dict`` the manager's dict), as the
        reward manager returns it in-process; raises a one-line :class:`RewardScoreError` if a score raised."""
        chunks = [(offset, future.result()) for offset, future in self._futures]
        for offset, out in chunks:
            if "error" in out:
                raise self._error(offset, out["error"])
        tensor = torch.cat([out["reward_tensor"] for _, out in chunks]).to(self._device)
        extra: dict[str, list] = {}
        for _, out in chunks:
            for key, values in out["reward_extra_info"].items():
                extra.setdefault(key, []).extend(values)
        return {"reward_tensor": tensor, "reward_extra_info": extra} if return_dict else tensor

    def _error(self, offset: int, error: dict[str, Any]) -> RewardScoreError:
        from verl.workers.reward_manager.naive import describe_sample

        first_line = (error["message"].strip().splitlines() or [""])[0]
        sample = error["sample"]
        if sample is None:
            where = f"rows from {self._row(offset)}"
        else:
            where = describe_sample({**sample, "row": self._row(offset + sample["row"])})
        cls = RewardScoreInputError if error["input_error"] else RewardScoreError
        err = cls(f"reward function raised {error['type']}: {first_line} (on {where} of the step's batch)")
        err.add_note("in the reward worker process:\n" + error["traceback"])
        return err

    def _row(self, local: int) -> int:
        return int(self._positions[local]) if self._positions is not None else local


class RewardPool:
    """``num_workers`` spawned processes scoring with copies of ``reward_fn`` (a reward manager: ``reward_fn(
    rows, return_dict=True)``); started here, so they boot while the trainer does other work."""

    def __init__(self, reward_fn: Callable, num_workers: int):
        if num_workers < 1:
            raise InputError(f"reward.num_workers: expected at least 1 worker for a reward pool, found {num_workers}")
        try:
            blob = pickle.dumps(reward_fn)
        except Exception as err:
            raise InputError(f"reward.num_workers={num_workers}: the reward function runs in spawned processes and "
                             f"must pickle; {type(reward_fn).__name__} does not ({type(err).__name__}: {err}): set "
                             f"reward.num_workers=0") from None
        self.reward_fn, self.num_workers = reward_fn, num_workers
        self.input_keys = getattr(reward_fn, "input_keys", None)
        self._executor = ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=(blob, os.getpid()))
        self._booting = [self._executor.submit(_ready) for _ in range(num_workers)]

    def wait_ready(self) -> None:
        """Block until every process has loaded its reward manager (benchmarks: time the steady state)."""
        for future in self._booting:
            future.result()

    def submit(self, rows: DataProto, positions: Sequence[int] | None = None) -> PendingRewards:
        """Start scoring ``rows`` (a snapshot of their fields is sent now); ``positions``: each row's position in
        the step's batch, for the error line (default: its index in ``rows``)."""
        keys = [k for k in rows.batch.keys() if self.input_keys is None or k in self.input_keys]
        n = len(rows)
        bounds = np.linspace(0, n, min(self.num_workers, n) + 1).round().astype(int) if n else np.array([0, 0])
        futures = []
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            batch = {k: rows.batch[k][lo:hi].detach().cpu().clone() for k in keys}
            non_tensor = {k: v[lo:hi] for k, v in rows.non_tensor_batch.items()}
            futures.append((lo, self._executor.submit(_score, batch, non_tensor)))
        device = rows.batch["responses"].device if "responses" in rows.batch.keys() else torch.device("cpu")
        return PendingRewards(futures, positions, device)

    def close(self) -> None:
        """Stop the processes (they exit on their own; not waited for here)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

