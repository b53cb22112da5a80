"""What a run spends before its first step: one clock from the launcher's start to the end of step 1.

The local launcher (or the first verl process of a job) hands its start to its ranks in ``VERL_LAUNCH_T0``
(seconds since the epoch); each rank marks its own phases (:func:`mark`) and rank 0 prints one line
after its first step and logs ``perf/time_to_first_step_s``. Under srun each task is its own first process, so
there the clock starts at the task's interpreter.
"""

from __future__ import annotations

import os
import time

LAUNCH_T0_ENV = "VERL_LAUNCH_T0"

_marks: list[tuple[str, float]] = []


def launch_time() -> float:
    """When this run's first verl process started: its launcher's start (``VERL_LAUNCH_T0``, which the launcher
    puts in its ranks' environment, see :func:`rank_environment`), else this process's."""
    try:
        return float(os.environ[LAUNCH_T0_ENV])
    except (KeyError, ValueError):
        return _process_start()


def rank_environment() -> dict[str, str]:
    """What a launcher adds to its ranks' environment so that their clock starts at its own start."""
    return {LAUNCH_T0_ENV: repr(launch_time())}


_started: dict[int, float] = {}  # pid -> start: one reading per process (a forked rank reads its own)


def _process_start() -> float:
    """This process's start time, so the interpreter's own start counts (Linux: /proc/self/stat's start in clock
    ticks since boot, against the boot clock now; elsewhere: the first call's time). Read once per process, so
    every phase is measured from the same start."""
    pid = os.getpid()
    if pid not in _started:
        try:
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
            _started[pid] = time.time() - max(0.0, since_start)
        except (OSError, ValueError, IndexError, AttributeError):
            _started[pid] = time.time()
    return _started[pid]


def mark_process_start(phase: str) -> None:
    """For a process the launcher started: ``phase`` (the launcher's work before it) ended when this process
    began. A no-op in the first process of a run."""
    if os.environ.get(LAUNCH_T0_ENV):
        _marks.append((phase, _process_start()))


def mark(phase: str) -> None:
    """``phase`` ended now (the phases of this process, in order)."""
    _marks.append((phase, time.time()))


def phases() -> list[tuple[str, float]]:
    """(phase, seconds) from the launch through each mark: what happened between the previous mark and this one."""
    out, previous = [], launch_time()
    for name, t in _marks:
        out.append((name, t - previous))
        previous = t
    return out


def summary_line(first_step_end: float) -> str:
    """One line: the time from the launch to the end of the first step and where it went."""
    total = first_step_end - launch_time()
    parts = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in phases())
    last = _marks[-1][1] if _marks else launch_time()
    return (f"startup: the first step ended {total:.2f}s after the launch ({parts}, "
            f"the step {first_step_end - last:.2f}s)")
