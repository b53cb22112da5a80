"""Local ranks forked from one process that imported their modules once (``verl train`` on CPU hosts).

A fresh `verl train` rank spends most of its start-up importing torch, Megatron and transformers (measured on the
2-core box: 3.6 s of imports per rank, 7.5 s from the launch to the end of a tiny first step; the launcher then
imports much of the same for its config check). The fork server is forked from the launcher once the config is
loaded (so it starts with the config's imports done), imports the rest of what a rank needs while the launcher
checks the config (in parallel on a second core), and forks every rank from there: each rank runs the same
``MODULE.main(argv)`` that ``python -m MODULE argv`` would, with the ranks' usual environment, its own session and
a pipe for its output, without an interpreter start or a single import of its own.

The ranks are the server's children: it reports each one's exit status to the launcher (a rank killed by a signal
reads as ``-signal``, as with ``subprocess``), they die with it and it dies with the launcher (PR_SET_PDEATHSIG),
so :class:`verl.launcher.spawn.LocalRanks` treats them as it treats processes it started itself.

One difference a user can see: what runs at an interpreter's start (a ``sitecustomize`` on the path) runs in the
launcher only, and a rank inherits its effects; ``VERL_RANK_START=exec`` runs it in every rank again.

Used only where forking is known safe; otherwise :meth:`ForkServer.start` returns None and the ranks start as
fresh interpreters, as before:
- Linux, and no GPU device node on the host: a CUDA driver an import touched does not survive ``fork``;
- ``VERL_RANK_START`` is not ``exec`` (the switch back to fresh interpreters);
- the launcher and the server hold one Python thread when they fork (checked each time: a library that started a
  thread in an import turns the fork down, and the launcher starts fresh interpreters).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing import Pipe
from multiprocessing.reduction import recv_handle, send_handle

from verl.launcher.spawn import FORWARDED_SIGNALS, die_with_parent

RANK_START_ENV = "VERL_RANK_START"  # "exec": every rank a fresh interpreter
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and ROCm's control devices


def fork_allowed(environ=os.environ) -> bool:
    """Whether ranks may be forked here (see the module doc)."""
    if environ.get(RANK_START_ENV, "").strip().lower() == "exec":
        return False
    return sys.platform.startswith("linux") and not any(os.path.exists(p) for p in GPU_DEVICE_NODES)


def _python_threads() -> int:
    """Python threads of this process: a second one may hold a lock (logging's, a stream's) that a forked child
    would wait on forever. (torch's and Arrow's native threads, started by their imports, hold none across a fork:
    both register fork handlers, as torch's DataLoader relies on when it forks its workers.)"""
    return threading.active_count()


class ForkedRank:
    """One forked rank, with the part of :class:`subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, server: ForkServer, pid: int, stdout):
        self.server, self.pid, self.stdout = server, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self.server.collect(wait_s=0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


class ForkServer:
    """The launcher's side: :meth:`start` forks the server, :meth:`start_ranks` has it fork the ranks."""

    def __init__(self, pid: int, conn):
        self.pid, self.conn = pid, conn
        self.ranks: dict[int, ForkedRank] = {}
        self._closed = False
        self._collecting = False  # the launcher's signal handler polls too: never inside a half-read message

    @classmethod
    def start(cls, preload: list[str], optional: tuple[str, ...] = ()) -> ForkServer | None:
        """Fork the server, which imports ``preload`` now (and each of ``optional`` that exists); None where
        forking is not allowed (see :func:`fork_allowed`) or this process already runs a second thread."""
        if not fork_allowed() or _python_threads() != 1:
            return None
        ours, theirs = Pipe(duplex=True)
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            stream.flush()
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:  # the server
            code = 0
            try:
                ours.close()
                _serve(theirs, preload, optional, launcher)
            except BaseException:  # noqa: BLE001 - the launcher sees the closed connection and starts ranks itself
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, ours)

    def start_ranks(self, specs: list[tuple[dict[str, str], str, list[str]]]) -> list[ForkedRank] | None:
        """Fork one rank per ``(environment, module, argv)``: ``module.main(argv)`` in it. None when the server
        turned the fork down or failed to import what it preloads (the caller starts fresh interpreters)."""
        try:
            self.conn.send(("ranks", specs))
            ready = self.conn.recv()
            if ready[0] != "forking":
                self.close()
                return None
            handles = [recv_handle(self.conn) for _ in specs]
            _, pids = self.conn.recv()
        except (EOFError, OSError):
            self.close()
            return None
        ranks = [ForkedRank(self, pid, os.fdopen(fd, "r", encoding="utf-8", errors="replace"))
                 for pid, fd in zip(pids, handles, strict=True)]
        self.ranks = {r.pid: r for r in ranks}
        return ranks

    def collect(self, wait_s: float = 0.0) -> None:
        """Read the exit statuses the server has reported; a server gone early leaves its ranks as killed (they
        die with it)."""
        if self._closed or self._collecting:
            return
        self._collecting = True
        try:
            while self.conn.poll(wait_s):
                wait_s = 0.0
                _, pid, code = self.conn.recv()
                if pid in self.ranks:
                    self.ranks[pid].returncode = code
        except (EOFError, OSError):
            for rank in self.ranks.values():
                if rank.returncode is None:
                    rank.returncode = -signal.SIGKILL
            self.close()
        finally:
            self._collecting = False

    def close(self) -> None:
        """End the server and reap it: at once when it forked no ranks (it may still be importing); else it exits
        by itself once it has reaped them (the launcher closes it after its ranks ended)."""
        if self._closed:
            return
        self._closed = True
        self.conn.close()
        for _ in range(50 if self.ranks else 0):
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                return
            time.sleep(0.02)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


# ------------------------------------------------------------------------------------------ the server side

def _serve(conn, preload: list[str], optional: tuple[str, ...], launcher: int) -> None:
    die_with_parent(launcher)
    # What a fresh interpreter would inherit: signals ignored stay ignored (nohup's SIGHUP), handled ones default.
    inherited = {signum: signal.getsignal(signum) == signal.SIG_IGN for signum in FORWARDED_SIGNALS}
    # The launcher forwards signals to the ranks itself; one sent to its process group (a terminal's Ctrl-C, a
    # kill of the group) must not end the server, whose death ends the ranks before they checkpoint.
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    # What the imports print (Megatron's warnings without Transformer Engine) is what every fresh rank printed
    # too; the server's console is the launcher's, where it would land mid-check: keep it quiet.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    imported = True
    try:
        for module in preload:
            importlib.import_module(module)
        for module in optional:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as err:
                if err.name != module:
                    raise
    except BaseException:  # noqa: BLE001 - a rank started fresh meets the same error and reports it
        imported = False
    try:
        _, specs = conn.recv()
    except EOFError:  # the launcher needed no ranks (one rank runs in the launcher, a bad config ends it)
        return
    if not imported or _python_threads() != 1:
        conn.send(("declined", "import" if not imported else "threads"))
        return
    conn.send(("forking", None))
    server, pids = os.getpid(), []
    for env, module, argv in specs:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _run_rank(conn, server, write, inherited, env, module, argv)
        os.close(write)
        send_handle(conn, read, launcher)
        os.close(read)
        pids.append(pid)
    conn.send(("pids", pids))
    left = set(pids)
    while left:
        pid, status = os.waitpid(-1, 0)
        if pid in left:
            left.discard(pid)
            conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))


def _run_rank(conn, server: int, out_fd: int, ignored: dict[int, bool], env: dict[str, str], module: str,
              argv: list[str]) -> None:
    """The forked rank: what ``python -m module argv`` does under the launcher (its own session, the rank's
    environment, stdout and stderr into the launcher's pipe), then exit with main's code."""
    code = 1
    try:
        os.setsid()
        die_with_parent(server)
        conn.close()
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        for signum, was_ignored in ignored.items():
            signal.signal(signum, signal.SIG_IGN if was_ignored else signal.SIG_DFL)
        preemption = sys.modules.get("verl.launcher.preemption")
        if preemption is not None:
            preemption._EARLY.clear()  # a signal the launcher held is the launcher's
        os.environ.clear()
        os.environ.update(env)
        # The interpreter's own streams on the pipe: not a launcher's wrapper (`--log_dir`'s copy into its log,
        # which the launcher writes with the rank prefix itself).
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        sys.stdout.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED=1 for a fresh rank
        torch = sys.modules.get("torch")
        if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # the environment came after torch's import
        main = importlib.import_module(module).main
        sys.argv = [main.__code__.co_filename, *argv]
        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as a fresh interpreter would
        traceback.print_exc()
        code = 1
    finally:
        from verl.launcher.bootstrap import exit_process

        exit_process(int(code or 0))
