"""Preemption: turn SIGUSR1/SIGTERM/SIGHUP into "finish this step, checkpoint, exit 0" on every rank.

Slurm sends the signal to some processes and not others (``--signal=B:USR1@120`` reaches the batch
shell, which forwards it to the step; ``scancel --signal`` reaches the tasks), and not at the same
instant. So the handler only records the request; `should_stop()` is a collective (MAX over ranks)
called once per step, and every rank sees the same answer at the same step.

Usage (the trainer loop and `launch.selftest` do this)::

    with PreemptionHandler() as preempt:
        for step in range(start, total):
            train_step(step)
            if preempt.should_stop():
                save_checkpoint(step)
                break
"""

from __future__ import annotations

import signal
import threading

# SIGHUP: the terminal closed or the ssh session was lost; by default it killed the ranks without a checkpoint.
DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP)
# The trainer's: Ctrl-C (SIGINT) too, so an interrupted run resumes.
TRAINER_SIGNALS = (*DEFAULT_SIGNALS, signal.SIGINT)


# SIGUSR1s that arrived before the handler was installed (hold_early_preemption): Slurm's time-limit or preemption
# signal can come while a rank is still starting, and its default action would kill the rank.
_EARLY: list[int] = []


def hold_early_preemption() -> None:
    """From process start: record a SIGUSR1 instead of dying of it; the next :class:`PreemptionHandler` installed
    honours it (the run checkpoints after its first step). Only SIGUSR1, whose default kills: SIGTERM/SIGHUP/SIGINT
    keep ending a rank that is still starting (a user's kill, Ctrl-C)."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        signal.signal(signal.SIGUSR1, lambda signum, frame: _EARLY.append(signum))


class PreemptionHandler:
    def __init__(self, signals=DEFAULT_SIGNALS):
        self.signals = tuple(signals)
        self.requested = False
        self.received_signal: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install: expected the main thread (Python only"
                               " delivers signals there), found "
                               f"{threading.current_thread().name}")
        for sig in self.signals:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: the user asked the run to outlive its terminal
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if _EARLY:  # a signal that came while the process was starting
            self._on_signal(_EARLY.pop(), None)
            _EARLY.clear()
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_signal(self, signum, frame) -> None:
        self.requested = True
        self.received_signal = signum

    def should_stop(self, group=None) -> bool:
        """True on every rank of ``group`` once any rank of it has received a preemption signal.

        A collective: all ranks of the group must call it at the same point of each step.
        Without an initialised process group it is this process's own flag.
        """
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return self.requested
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32,
                            device=_collective_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


def _collective_device(group):
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
