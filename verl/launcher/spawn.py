"""Local ranks: the one spawner of verl-hpc.

Every local rank is an OS process started by :class:`LocalRanks` with torchrun's environment convention
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT) and the same rules:

- fail-fast: as soon as one rank exits non-zero the others are terminated (SIGTERM to each rank's process
  group, SIGKILL after a grace period); a deadline ends them all the same way;
- SIGINT/SIGTERM/SIGUSR1/SIGHUP sent to the launcher are forwarded to every rank (SIGHUP not under nohup).
  Ranks run in their own sessions, so a terminal's Ctrl-C reaches them once (through the launcher), not twice;
- children die with their parent: every rank (and every child started through :func:`child_preexec`)
  asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``, Linux), so a launcher killed
  with SIGKILL, or crashing, leaves no orphan rank;
- one thread policy (:mod:`verl.launcher.threads`): the ranks split this host's cores.

Two front doors over it:

``spawn_local(nproc, argv)`` runs a command as N ranks (what ``verl train`` and ``verl generate`` use), its
output streamed line by line with a ``[rank N]`` prefix. Exit code: 0 when every rank exits 0; else the
first failing rank's code, ``128 + signal`` for a rank killed by a signal (the shell's convention).

``run_ranks(fn, nproc, *args)`` runs an importable function on N gloo ranks (``verl.launcher.function_rank``
is the rank's side: a ``file://`` rendezvous in a private temp dir, no TCP listener) and returns each rank's
value; used by ``verl sft``, convert, generate, bench reshard and the multi-rank tests. The first rank to
fail, or the time limit, ends every rank and raises :class:`RankFailure` naming it.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from verl.launcher.env import LOOPBACK, LaunchError
from verl.launcher.threads import intra_op_threads

# SIGHUP: a closed terminal or lost ssh session; the ranks checkpoint and stop as for SIGTERM.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
KILL_GRACE_S = 5.0


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_libc = None


def without_option(argv: list[str], *names: str) -> list[str]:
    """``argv`` without the options ``names`` and their values (``--name V`` and ``--name=V``): what a
    re-executed child must not see again."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in names:
            skip = True
        elif not item.startswith(tuple(f"{name}=" for name in names)):
            out.append(item)
    return out


def _prctl():
    """libc's prctl, loaded in the parent (a forked child before exec should not dlopen)."""
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        _libc = ctypes.CDLL(None, use_errno=True)
    return None if _libc is None else _libc.prctl


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent exits (Linux; elsewhere a
    no-op). A parent that is already gone (the race before the call) ends this process at once."""
    prctl = _prctl()
    if prctl is None:
        return
    if prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)


def child_preexec(signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``subprocess.Popen(preexec_fn=...)`` that makes the child die with this process (the thread that
    starts it must outlive it: the kernel ties the signal to the creating thread)."""
    parent = os.getpid()
    _prctl()  # loaded here, before the fork

    def preexec() -> None:
        die_with_parent(parent, signum)

    return preexec


def free_loopback_port() -> int:
    # The port is released before rank 0 binds it; the kernel does not hand it out again at once.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port),
               PYTHONUNBUFFERED="1")
    # The ranks share this host's cores: without a cap each one starts a thread per core and they
    # oversubscribe the machine (torchrun caps at 1; an explicit OMP_NUM_THREADS wins).
    env.setdefault("OMP_NUM_THREADS", str(intra_op_threads(nproc, environ=base)))
    return env


class LocalRanks:
    """N rank processes of one command on this host, run to the end by :meth:`wait`.

    prefix_output: stream each rank's stdout+stderr to ``out`` line by line with a ``[rank N]`` prefix
    (a job log); False: the ranks write to this process's own stdout/stderr (a terminal's progress bars
    stay intact). After :meth:`wait`, ``failed_rank`` is the first rank that failed (None: none, or the
    deadline passed first: ``timed_out``).
    """

    def __init__(self, nproc: int, argv: list[str], env: dict[str, str] | None = None,
                 master_port: int | None = None, out=None, prefix_output: bool = True, forkserver=None):
        if not isinstance(nproc, int) or nproc < 1:
            raise LaunchError(f"local ranks: expected nproc >= 1, found {nproc!r}")
        if not argv:
            raise LaunchError("local ranks: expected a command to run, found an empty argv")
        self.nproc, self.argv, self.prefix_output = nproc, list(argv), prefix_output
        self.out = out or sys.stdout
        self.port = master_port or free_loopback_port()
        self.base = dict(os.environ if env is None else env)
        self.procs: list[subprocess.Popen] = []
        self.failed_rank: int | None = None
        self.failed_ranks: list[int] = []
        self.timed_out = False
        self._write_lock = threading.Lock()
        # A verl.launcher.forkserver.ForkServer: ranks of `python -m MODULE ...` forked from it, not started fresh.
        self.forkserver = forkserver if prefix_output and self.argv[1:2] == ["-m"] else None

    def _pump(self, rank: int, stream) -> None:
        for line in iter(stream.readline, ""):
            with self._write_lock:
                try:
                    self.out.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
                    self.out.flush()
                except (OSError, ValueError):
                    # The terminal is gone (EIO after a hangup) or closed: keep draining, or the rank blocks on a
                    # full pipe and never reaches its checkpoint.
                    pass
        stream.close()

    def _forward(self, signum, frame) -> None:
        # To the rank process alone: it stops what it started itself. Its whole group would include helpers
        # with no handler (Megatron's checkpoint writer processes), which died mid-save and failed the run.
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait(self, timeout_s: float = float("inf")) -> int:
        """Start the ranks and wait for them: 0, or the first failing rank's exit code (124 when the
        deadline ends them, as coreutils' ``timeout``). Every rank is gone when this returns."""
        installed = {}
        if threading.current_thread() is threading.main_thread():
            # Under nohup SIGHUP stays ignored, here and (inherited) in the ranks: the run outlives the terminal.
            installed = {s: signal.signal(s, self._forward) for s in FORWARDED_SIGNALS
                         if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)}
        pumps = []
        try:
            forked = None
            if self.forkserver is not None:
                forked = self.forkserver.start_ranks(
                    [(rank_env(rank, self.nproc, self.port, self.base), self.argv[2], self.argv[3:])
                     for rank in range(self.nproc)])
            for rank, p in enumerate(forked or ()):
                self.procs.append(p)
                t = threading.Thread(target=self._pump, args=(rank, p.stdout), daemon=True)
                t.start()
                pumps.append(t)
            for rank in range(self.nproc if forked is None else 0):
                piped = subprocess.PIPE if self.prefix_output else None
                p = subprocess.Popen(self.argv, env=rank_env(rank, self.nproc, self.port, self.base),
                                     stdout=piped, stderr=subprocess.STDOUT if self.prefix_output else None,
                                     text=True, bufsize=1, start_new_session=True, preexec_fn=child_preexec())
                self.procs.append(p)
                if self.prefix_output:
                    t = threading.Thread(target=self._pump, args=(rank, p.stdout), daemon=True)
                    t.start()
                    pumps.append(t)
            return self._wait_fail_fast(time.monotonic() + timeout_s)
        finally:
            _terminate(self.procs)
            for s, previous in installed.items():
                signal.signal(s, previous)
            for t in pumps:
                t.join(timeout=5)

    def _wait_fail_fast(self, deadline: float) -> int:
        while True:
            running = False
            for rank, p in enumerate(self.procs):
                rc = p.poll()
                if rc is None:
                    running = True
                elif rc != 0:
                    # Every rank that had failed on its own by now (a peer's death fails the others soon after).
                    self.failed_ranks = [r for r, q in enumerate(self.procs) if q.poll() not in (None, 0)]
                    self.failed_rank = rank
                    return 128 - rc if rc < 0 else rc
            if not running:
                return 0
            if time.monotonic() >= deadline:
                self.timed_out = True
                return 124
            time.sleep(0.05)


def spawn_local(nproc: int, argv: list[str], env: dict[str, str] | None = None,
                master_port: int | None = None, out=None, failure: dict | None = None, forkserver=None) -> int:
    """Run ``argv`` as ``nproc`` local ranks; return 0 or the first failing rank's exit code.

    env: base environment of the ranks (default: this process's); master_port: default a free one;
    out: text stream for the prefixed output (default sys.stdout); failure: filled with the first failing
    rank (``rank``) and, when a signal killed it, the signal (``signal``, else None): a rank killed leaves no
    error line of its own. forkserver: a :class:`verl.launcher.forkserver.ForkServer` to fork the ranks of a
    ``python -m MODULE`` argv from (they start as fresh interpreters where it declines).
    """
    ranks = LocalRanks(nproc, argv, env=env, master_port=master_port, out=out, forkserver=forkserver)
    code = ranks.wait()
    if failure is not None and ranks.failed_rank is not None:
        # A rank a signal killed is the cause when peers failed by the same poll (their errors follow from it).
        killed = [r for r in ranks.failed_ranks if ranks.procs[r].returncode < 0]
        rank = killed[0] if killed else ranks.failed_rank
        returncode = ranks.procs[rank].returncode
        failure.update(rank=rank, signal=-returncode if returncode < 0 else None)
        if returncode < 0:
            code = 128 - returncode
    return code


def _signal_group(p: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(p.pid, signum)  # the rank and anything it started
    except ProcessLookupError:
        pass


def _terminate(procs: list[subprocess.Popen]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()
    # Children of a rank that exited on its own may still hold its process group.
    for p in procs:
        _signal_group(p, signal.SIGKILL)


# --------------------------------------------------------------------------- function ranks

class RankFailure(RuntimeError):
    """A spawned rank raised, died, or the ranks ran past their time limit."""


# The files a function rank reads and writes in the job's private directory (verl.launcher.function_rank).
JOB_FILE = "job.pkl"
RENDEZVOUS_FILE = "rendezvous"


def result_file(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"result.{rank}.pt")


def error_file(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"error.{rank}.txt")


def _importable(fn: Callable[..., Any]) -> tuple[str, str]:
    """(module, qualname) a fresh interpreter imports ``fn`` by; a function of a script run as
    ``python -m pkg.mod`` is found under its module's real name."""
    module = fn.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise LaunchError(f"run_ranks: expected a function importable by module name, found "
                              f"{fn.__qualname__} in a script run by path")
        module = spec.name
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise LaunchError(f"run_ranks: expected a module-level function, found {fn.__qualname__}")
    return module, fn.__qualname__


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
              threads_per_rank: int = 1, with_rank: bool = False) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks with torch.distributed initialised; returns per-rank values.

    ``fn`` must be importable (module level); it returns tensors, numbers, strings, lists and dicts
    (what ``torch.load(weights_only=True)`` accepts). with_rank: call ``fn(rank, world_size, *args)``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive integer, found {world_size!r}")
    import torch  # here, not at module level: spawn_local's launchers need no torch

    with tempfile.TemporaryDirectory(prefix="verl_ranks_") as job_dir:  # mode 0700: this user's only
        with open(os.path.join(job_dir, JOB_FILE), "wb") as f:
            # The same trust as multiprocessing's spawn: this process pickles, its own children unpickle.
            pickle.dump({"fn": _importable(fn), "args": args, "threads": threads_per_rank,
                         "with_rank": with_rank}, f)
        env = dict(os.environ)
        # The rank imports fn the way this process does (test modules, a checkout not installed).
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ranks = LocalRanks(world_size, [sys.executable, "-m", "verl.launcher.function_rank", job_dir],
                           env=env, prefix_output=False)
        code = ranks.wait(timeout_s)
        if ranks.timed_out:
            done = [r for r in range(world_size) if os.path.exists(result_file(job_dir, r))]
            raise RankFailure(f"ranks: expected {world_size} results within {timeout_s:.0f}s, "
                              f"found {len(done)} (ranks {done})")
        if code != 0:
            rank = _first_failure(job_dir, ranks.failed_ranks)
            code = ranks.procs[rank].returncode
            path = error_file(job_dir, rank)
            if os.path.exists(path):
                with open(path) as f:
                    raise RankFailure(f"rank {rank} failed:\n{f.read().split(chr(10), 1)[1]}")
            raise RankFailure(f"rank {rank} died with exit code {128 - code if code < 0 else code}")
        values = []
        for rank in range(world_size):
            with open(result_file(job_dir, rank), "rb") as f:
                values.append(torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True))
    return values


def _first_failure(job_dir: str, failed: list[int]) -> int:
    """The rank whose failure came first among ``failed``: one that died without a traceback (killed, or
    exited hard: its peers' errors follow from it), else the earliest traceback's (each starts with its time)."""
    times = {}
    for rank in failed:
        try:
            with open(error_file(job_dir, rank)) as f:
                times[rank] = float(f.readline())
        except (OSError, ValueError):
            return rank
    return min(times, key=lambda r: (times[r], r))


def run_ranks_with_rank(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
                        threads_per_rank: int = 1) -> list[Any]:
    """Like :func:`run_ranks`, calling ``fn(rank, world_size, *args)``."""
    return run_ranks(fn, world_size, *args, timeout_s=timeout_s, threads_per_rank=threads_per_rank,
                     with_rank=True)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m verl.launcher.spawn",
                                description="Run a command as N local ranks (torchrun env convention).")
    p.add_argument("--nproc", type=int, required=True, help="number of local ranks")
    p.add_argument("--master-port", type=int, default=None, help="default: a free loopback port")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="command and its arguments")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.nproc < 1:
        p.error(f"--nproc: expected >= 1, found {args.nproc}")
    if not cmd:
        p.error("expected a command after the options, found none")
    return spawn_local(args.nproc, cmd, master_port=args.master_port)


if __name__ == "__main__":
    sys.exit(main())
