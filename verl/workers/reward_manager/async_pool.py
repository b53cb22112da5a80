"""Rewards off the critical path: verl's ``reward.num_workers`` (and the legacy
``reward_model.launch_reward_fn_async``, one worker).

A :class:`RewardPool` holds ``num_workers`` spawned processes, each with its own copy of the trainer's reward
manager (pickled once when the pool starts: the tokenizer, and the scorer as a built-in or as the user file's
path and name, which the process loads again). :meth:`RewardPool.submit` splits a batch's rows into contiguous
chunks, one per process, and returns at once; the step runs its old-log-prob, reference and value passes and
calls :meth:`PendingRewards.result` before the advantage. A slow Python scorer runs in other processes, so it
holds neither this rank's GIL nor its cores' torch threads (each process runs torch with one thread).

Every sample is scored by the same manager code as the synchronous path, so the scores and
``reward_extra_info`` are the same. A score that raises, or is NaN or infinite, fails the step with one line
naming the exception, the sample's row in the step's batch and its data source; the user's traceback is attached
as a note.

Failures of the processes themselves (each process reports the row it is scoring and since when, in shared
memory):

* a sample still scoring after ``reward.timeout_s`` (a hung scorer: a lock, a regex that backtracks forever, a
  network call) ends the step with :class:`RewardScoreTimeout` naming its row within about a second of the limit;
  the processes are killed and a fresh pool started (a hung process cannot be interrupted from outside);
* a process that dies (the OOM killer, a segfault in a native scorer) breaks the executor
  (``BrokenProcessPool``): the pool is started again and the unfinished rows scored again, once, with a warning
  naming the row the dead process was scoring; dying again is :class:`RewardWorkerDied` naming that row.
A reward manager other than :class:`~verl.workers.reward_manager.naive.NaiveRewardManager` does not report its
rows: the first row of the chunk its process was scoring is named, and the limit applies to that whole chunk.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np
import torch

from verl.errors import InputError
from verl.protocol import DataProto

logger = logging.getLogger(__name__)

_MANAGER: Callable | None = None  # a worker process's reward manager (set by _init_worker)
_SLOT = -1                        # this worker's index in the pool's shared progress arrays
_STATE: tuple | None = None       # (rows, started, pids): the pool's shared arrays, as this worker sees them
POLL_S = 0.25                     # how often a waiting trainer looks at the processes' progress
IDLE = -1                         # a slot's row while it scores nothing


class RewardScoreError(RuntimeError):
    """A reward function that raised in a reward worker process (an internal error of the user's code: exit 1)."""


class RewardScoreInputError(RewardScoreError, InputError):
    """The same, where the reward function raised a :class:`verl.errors.InputError` (exit 2, as in-process)."""


class RewardScoreTimeout(RewardScoreError):
    """A sample still scoring after ``reward.timeout_s``."""


class RewardWorkerDied(RewardScoreError):
    """A reward worker process died (killed by a signal or exited) twice while scoring the same step's rows."""


def _init_worker(manager_blob: bytes, parent_pid: int, rows: Any, started: Any, pids: Any, slots: Any) -> None:
    global _MANAGER, _SLOT, _STATE
    from verl.launcher.spawn import die_with_parent

    # Gone with the rank, even a SIGKILLed one: an orphaned worker would wait on its queue forever, a process
    # left behind on the node (Slurm's job end does not reach a process reparented away from the step).
    die_with_parent(parent_pid)
    # One torch thread: the pool's processes share the rank's cores with its training threads.
    torch.set_num_threads(1)
    with slots.get_lock():
        _SLOT = slots.value
        slots.value += 1
    _STATE = (rows, started, pids)
    rows[_SLOT], pids[_SLOT] = IDLE, os.getpid()
    _MANAGER = pickle.loads(manager_blob)


def _ready() -> bool:
    return _MANAGER is not None


def _mark(row: int) -> None:
    rows, started, _ = _STATE
    started[_SLOT] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
    rows[_SLOT] = row


def _score(batch: dict[str, torch.Tensor], non_tensor: dict[str, np.ndarray], offset: int = 0) -> dict[str, Any]:
    """One chunk's ``{"reward_tensor", "reward_extra_info"}``, or ``{"error": ...}`` describing what raised (the
    exception itself may be of a class only this process can import: the user's file). ``offset``: the chunk's
    first row among the submitted rows (what this process reports as the row it is scoring)."""
    from verl.workers.reward_manager.naive import NonFiniteScoreError, check_finite_scores

    _mark(offset)
    has_hook = hasattr(_MANAGER, "on_row")
    if has_hook:
        _MANAGER.on_row = lambda i: _mark(offset + i)
    try:
        out = _MANAGER(DataProto.from_dict(batch, non_tensor), return_dict=True)
        check_finite_scores(out["reward_tensor"])  # any manager's, not only the naive one's
    except Exception as err:
        message = str(err)
        if isinstance(err, NonFiniteScoreError):  # the pool names the row in the step's batch itself
            message = f"expected a finite score, found {err.score!r}"
        sample = getattr(err, "reward_sample", None)
        if sample is None and isinstance(err, NonFiniteScoreError) and err.row is not None:
            sample = {"row": err.row, "data_source": None, "index": None}
        return {"error": {"type": type(err).__name__, "message": message, "input_error": isinstance(err, InputError),
                          "sample": sample, "traceback": traceback.format_exc()}}
    finally:
        if has_hook:
            _MANAGER.on_row = None
        _STATE[0][_SLOT] = IDLE
    return {"reward_tensor": out["reward_tensor"].cpu(), "reward_extra_info": dict(out["reward_extra_info"])}


class PendingRewards:
    """The rewards of one submitted batch, being computed; :meth:`result` waits for them."""

    def __init__(self, pool: RewardPool, chunks: list[tuple[int, dict, dict]], positions: Sequence[int] | None,
                 device: torch.device, data_sources: Sequence[Any] | None):
        self._pool, self._chunks, self._positions, self._device = pool, chunks, positions, device
        self._data_sources = data_sources
        self._futures = pool._send(chunks)

    def result(self, return_dict: bool = False):
        """``reward_tensor`` [rows, R] of the submitted rows (with ``return_dict`` the manager's dict), as the
        reward manager returns it in-process; raises a one-line :class:`RewardScoreError` if a score raised,
        took longer than ``reward.timeout_s``, or its process died twice."""
        outputs: dict[int, dict] = {}
        restarted = False
        while True:
            try:
                self._wait(outputs)
                break
            except BrokenProcessPool:
                row, how = self._pool._dead_worker()
                where = self._where(row)
                self._pool._restart()  # the next step has a working pool, whatever happens to this one
                if restarted:
                    raise RewardWorkerDied(f"reward worker process {how} again while scoring {where} of the "
                                           f"step's batch (it died there before and was restarted): lower the "
                                           f"scorer's memory, or set reward.num_workers=0 to score in the "
                                           f"step") from None
                logger.warning("reward worker process %s while scoring %s of the step's batch; restarting the "
                               "pool and scoring the unfinished rows again", how, where)
                restarted = True
                pending = [chunk for chunk in self._chunks if chunk[0] not in outputs]
                self._futures = self._pool._send(pending)
        chunks = [(offset, outputs[offset]) for offset, _, _ in self._chunks]
        for offset, out in chunks:
            if "error" in out:
                raise self._error(offset, out["error"])
        tensor = torch.cat([out["reward_tensor"] for _, out in chunks]).to(self._device)
        extra: dict[str, list] = {}
        for _, out in chunks:
            for key, values in out["reward_extra_info"].items():
                extra.setdefault(key, []).extend(values)
        return {"reward_tensor": tensor, "reward_extra_info": extra} if return_dict else tensor

    def _wait(self, outputs: dict[int, dict]) -> None:
        """Collect every chunk's output into ``outputs`` (by offset), watching the processes' progress."""
        pending = dict(self._futures)
        while pending:
            done, _ = wait(list(pending.values()), timeout=POLL_S, return_when=FIRST_EXCEPTION)
            for offset in [o for o, f in pending.items() if f in done]:
                outputs[offset] = pending.pop(offset).result()  # BrokenProcessPool propagates
            late = self._pool._late_row()
            if late is not None:
                row, elapsed = late
                self._pool._kill_and_restart()
                raise RewardScoreTimeout(f"reward function: expected a score within reward.timeout_s="
                                         f"{self._pool.timeout_s:g} s, found {self._where(row)} of the step's "
                                         f"batch still scoring after {elapsed:.1f} s (its processes were killed "
                                         f"and restarted)")

    def _where(self, row: int | None) -> str:
        if row is None:
            return "an unknown row"
        where = f"row {self._row(row)}"
        if self._data_sources is not None:
            where += f" (data_source={self._data_sources[row]!r})"
        return where

    def _error(self, offset: int, error: dict[str, Any]) -> RewardScoreError:
        from verl.workers.reward_manager.naive import describe_sample

        first_line = (error["message"].strip().splitlines() or [""])[0]
        sample = error["sample"]
        if sample is None:
            where = f"rows from {self._row(offset)}"
        elif sample.get("data_source") is None and self._data_sources is not None:
            where = self._where(offset + sample["row"])
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
    rows, return_dict=True)``); started here, so they boot while the trainer does other work. ``timeout_s``
    (``reward.timeout_s``; None: no limit): the longest one sample may score."""

    def __init__(self, reward_fn: Callable, num_workers: int, timeout_s: float | None = None):
        if num_workers < 1:
            raise InputError(f"reward.num_workers: expected at least 1 worker for a reward pool, found {num_workers}")
        if timeout_s is not None and not timeout_s > 0:
            raise InputError(f"reward.timeout_s: expected a positive number of seconds or null, found {timeout_s}")
        try:
            self._blob = pickle.dumps(reward_fn)
        except Exception as err:
            raise InputError(f"reward.num_workers={num_workers}: the reward function runs in spawned processes and "
                             f"must pickle; {type(reward_fn).__name__} does not ({type(err).__name__}: {err}): set "
                             f"reward.num_workers=0") from None
        self.reward_fn, self.num_workers, self.timeout_s = reward_fn, num_workers, timeout_s
        self.input_keys = getattr(reward_fn, "input_keys", None)
        self.reward_fn_key = getattr(reward_fn, "reward_fn_key", "data_source")
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._rows = ctx.Array("q", [IDLE] * self.num_workers, lock=False)
        self._started = ctx.Array("d", self.num_workers, lock=False)
        self._pids = ctx.Array("q", self.num_workers, lock=False)
        # Kept here: a process started later (the executor starts them as work arrives) attaches to it then.
        self._slots = ctx.Value("i", 0)
        self._executor = ProcessPoolExecutor(self.num_workers, mp_context=ctx, initializer=_init_worker,
                                             initargs=(self._blob, os.getpid(), self._rows, self._started,
                                                       self._pids, self._slots))
        self._booting = [self._executor.submit(_ready) for _ in range(self.num_workers)]
        self._processes = dict(self._executor._processes)  # pid -> Process: their exit codes once broken

    def wait_ready(self) -> None:
        """Block until every process has loaded its reward manager (benchmarks: time the steady state)."""
        for future in self._booting:
            future.result()
        self._processes = dict(self._executor._processes)

    def submit(self, rows: DataProto, positions: Sequence[int] | None = None) -> PendingRewards:
        """Start scoring ``rows`` (a snapshot of their fields is sent now); ``positions``: each row's position in
        the step's batch, for the error line (default: its index in ``rows``)."""
        keys = [k for k in rows.batch.keys() if self.input_keys is None or k in self.input_keys]
        n = len(rows)
        bounds = np.linspace(0, n, min(self.num_workers, n) + 1).round().astype(int) if n else np.array([0, 0])
        chunks = []
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            batch = {k: rows.batch[k][lo:hi].detach().cpu().clone() for k in keys}
            non_tensor = {k: v[lo:hi] for k, v in rows.non_tensor_batch.items()}
            chunks.append((lo, batch, non_tensor))
        device = rows.batch["responses"].device if "responses" in rows.batch.keys() else torch.device("cpu")
        sources = rows.non_tensor_batch.get(self.reward_fn_key)
        return PendingRewards(self, chunks, positions, device, None if sources is None else list(sources))

    def _send(self, chunks: list[tuple[int, dict, dict]]) -> dict[int, Future]:
        try:
            futures = {lo: self._executor.submit(_score, batch, non_tensor, lo) for lo, batch, non_tensor in chunks}
        except BrokenProcessPool:  # a process died while the pool was idle (between steps): a fresh pool
            logger.warning("a reward worker process died between steps; restarting the pool")
            self._restart()
            futures = {lo: self._executor.submit(_score, batch, non_tensor, lo) for lo, batch, non_tensor in chunks}
        self._processes.update(self._executor._processes)
        return futures

    def _late_row(self) -> tuple[int, float] | None:
        """(row, seconds) of a sample scoring for longer than ``timeout_s``, if any."""
        if self.timeout_s is None:
            return None
        now = time.monotonic()
        for slot in range(self.num_workers):
            row = self._rows[slot]
            if row != IDLE and now - self._started[slot] > self.timeout_s:
                if self._rows[slot] == row:  # not moved on meanwhile
                    return int(row), now - self._started[slot]
        return None

    def _dead_worker(self) -> tuple[int | None, str]:
        """(row it was scoring, how it ended) of the process whose death broke the executor: the one not ended
        by the executor's own SIGTERM to the others."""
        deadline = time.monotonic() + 5
        codes: dict[int, int | None] = {}
        while time.monotonic() < deadline:
            # (the executor's own thread reaps them too: a code may show only after its join has set it)
            codes = {slot: self._exit_code(int(pid)) for slot, pid in enumerate(self._pids) if pid}
            if all(code is not None for code in codes.values()):
                break
            time.sleep(0.05)
        for slot, code in codes.items():
            if code is not None and code != -signal.SIGTERM:
                row = int(self._rows[slot])
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
                return (row if row != IDLE else None), how
        busy = [int(row) for row in self._rows if row != IDLE]  # no exit code to go by: a row it was scoring
        return (busy[0] if busy else None), "died"

    def _exit_code(self, pid: int) -> int | None:
        process = self._processes.get(pid)
        if process is None:
            return None
        try:
            process.join(timeout=0.05)
        except (AssertionError, OSError):
            pass
        return process.exitcode

    def _restart(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.restarts += 1
        self._start()

    def _kill_and_restart(self) -> None:
        for process in list(self._executor._processes.values()):
            process.kill()
        self._restart()

    def close(self) -> None:
        """Stop the processes (they exit on their own; not waited for here)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
