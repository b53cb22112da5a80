"""Local ranks, the one spawner of verl-hpc. Two front doors:

``spawn_local(nproc, argv)`` runs a command as N rank subprocesses (what ``verl train --nproc N`` uses;
torchrun's env convention):

- each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT;
- output is streamed line by line with a ``[rank N]`` prefix;
- fail-fast: as soon as one rank exits non-zero the others are terminated (SIGTERM, then SIGKILL
  after a grace period) and that rank's exit code is returned;
- SIGINT/SIGTERM/SIGUSR1 sent to the launcher are forwarded to every rank. Ranks run in their own
  sessions, so a terminal's Ctrl-C reaches them once (through the launcher), not twice.
- children die with their parent: every rank (and every child started through :func:`child_preexec`)
  asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``, Linux), so a launcher
  killed with SIGKILL, or crashing, leaves no orphan rank; the launcher's own exit paths (return,
  exception, forwarded signal) end each rank's process group.

``run_ranks(fn, nproc, *args)`` runs an importable function on N gloo ranks over a ``file://``
rendezvous in a fresh temp dir (no TCP listener) and returns each rank's value; used by convert,
generate, sft, bench reshard and the multi-rank tests. The first rank to fail, or the timeout, ends
every rank.

spawn_local's exit code: 0 when every rank exits 0; else the first failing rank's code, ``128 + signal`` for a
rank killed by a signal (the shell's convention).
"""

from __future__ import annotations

import ctypes
import io
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from verl.launcher.bootstrap import DEFAULT_TIMEOUT_S, destroy_distributed, use_shm_collectives
from verl.launcher.env import LOOPBACK, LaunchError
from verl.launcher.threads import intra_op_threads

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
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


def spawn_local(nproc: int, argv: list[str], env: dict[str, str] | None = None,
                master_port: int | None = None, out=None) -> int:
    """Run ``argv`` as ``nproc`` local ranks; return 0 or the first failing rank's exit code.

    env: base environment of the ranks (default: this process's); master_port: default a free one;
    out: text stream for the prefixed output (default sys.stdout).
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise LaunchError(f"spawn_local: expected nproc >= 1, found {nproc!r}")
    if not argv:
        raise LaunchError("spawn_local: expected a command to run, found an empty argv")
    out = out or sys.stdout
    port = master_port or free_loopback_port()
    base = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen] = []
    write_lock = threading.Lock()

    def pump(rank: int, stream) -> None:
        for line in iter(stream.readline, ""):
            with write_lock:
                out.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
                out.flush()
        stream.close()

    def forward(signum, frame) -> None:
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signum)

    installed = {}
    if threading.current_thread() is threading.main_thread():
        installed = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    pumps = []
    try:
        for rank in range(nproc):
            p = subprocess.Popen(argv, env=rank_env(rank, nproc, port, base), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1,
                                 start_new_session=True, preexec_fn=child_preexec())
            procs.append(p)
            t = threading.Thread(target=pump, args=(rank, p.stdout), daemon=True)
            t.start()
            pumps.append(t)
        code = _wait_fail_fast(procs)
    finally:
        _terminate(procs)
        for s, previous in installed.items():
            signal.signal(s, previous)
        for t in pumps:
            t.join(timeout=5)
    return code


def _wait_fail_fast(procs: list[subprocess.Popen]) -> int:
    while True:
        running = False
        for p in procs:
            rc = p.poll()
            if rc is None:
                running = True
            elif rc != 0:
                return 128 - rc if rc < 0 else rc
        if not running:
            return 0
        time.sleep(0.05)


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


def _rank_main(fn, rank, world_size, init_file, threads, results, args, parent_pid=None):
    if parent_pid is not None:
        die_with_parent(parent_pid)  # first: a parent killed while this rank imports torch takes it along
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        use_shm_collectives(DEFAULT_TIMEOUT_S)  # as verl train's ranks do
        # Bytes, not tensors: torch's shared-memory handles die with a rank that already exited.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which ends every rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
              threads_per_rank: int = 1) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks with torch.distributed initialised; returns per-rank values.

    ``fn`` must be importable (module level); it returns tensors, numbers, strings, lists and dicts
    (what ``torch.load(weights_only=True)`` accepts).
    """
    import torch  # here, not at module level: spawn_local's launchers need no torch
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size: expected a positive integer, found {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="verl_ranks_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # Not daemonic: dist_checkpointing's saver starts a child process of its own.
        procs = [ctx.Process(target=_rank_main,
                             args=(fn, rank, world_size, init_file, threads_per_rank, results, args,
                                   os.getpid()))
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
                values[rank] = torch.load(io.BytesIO(value), map_location="cpu", weights_only=True)
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
                        threads_per_rank: int = 1) -> list[Any]:
    """Like :func:`run_ranks`, calling ``fn(rank, world_size, *args)``."""
    return run_ranks(_call_with_rank, world_size, fn, *args, timeout_s=timeout_s, threads_per_rank=threads_per_rank)


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
