"""Spawn N local ranks as subprocesses (what ``verl train --nproc N`` uses; torchrun's env convention).

- each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT;
- output is streamed line by line with a ``[rank N]`` prefix;
- fail-fast: as soon as one rank exits non-zero the others are terminated (SIGTERM, then SIGKILL
  after a grace period) and that rank's exit code is returned;
- SIGINT/SIGTERM/SIGUSR1 sent to the launcher are forwarded to every rank. Ranks run in their own
  sessions, so a terminal's Ctrl-C reaches them once (through the launcher), not twice.

Exit code: 0 when every rank exits 0; else the first failing rank's code, ``128 + signal`` for a
rank killed by a signal (the shell's convention).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from launch.env import LOOPBACK, LaunchError

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
KILL_GRACE_S = 5.0


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
                                 start_new_session=True)
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


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m launch.spawn",
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
