"""Run model-written Python in a sandbox (the ``code_interpreter`` tool, :mod:`verl.tools.code_interpreter`, is
built on it).

Each run is one ``bwrap`` (bubblewrap, Debian's ``bubblewrap`` package) process tree with:

* its own user, mount, PID, network, IPC and UTS namespaces (``--unshare-all --unshare-user``): no network
  interface but loopback, no view of the host's processes; it dies with its parent (``--die-with-parent``) and
  killing it kills everything it started (PID 1 of its namespace). ``--disable-userns``: the program cannot open
  a user namespace of its own (where it would hold every capability);
* a root made only of the host's ``/usr`` read-only (plus the merged-usr links ``/bin``, ``/lib``...): the
  project, ``/work``, ``$HOME``, ``/etc`` and ``/root`` are simply not there; ``/tmp`` and ``/dev/shm`` are
  private tmpfs of a fixed size (the disk cannot be filled), ``/dev`` is read-only;
* rlimits (``prlimit``), set *inside* the namespaces, on the program. ``RLIMIT_NPROC`` counts the processes and
  threads of a uid within one user namespace, and at the namespace's creation the creator's limit becomes the cap
  on its whole uid: set outside (as before), 32 processes would have bounded every thread of the user on the
  host, and a training rank alone has more (bwrap then fails with EAGAIN). Inside the run's own namespace the
  count starts at zero, so ``max_processes`` bounds this run's processes and threads only, and concurrent runs do
  not share it. When we run as root the run also drops to a uid of its own (``RLIMIT_NPROC`` does not bind root);
* a wall-clock deadline: past it the tree is killed and the result says ``timed_out``; stdout and stderr are
  each kept to ``max_output_bytes`` (a run that prints more is killed and marked ``truncated``).

What is bounded per run: processes and threads (``max_processes``), wall time, output, ``/tmp`` and ``/dev/shm``.
Per process: CPU seconds, address space (``memory_bytes``) and file size, so a run's memory is bounded by
``max_processes x memory_bytes``, not ``memory_bytes``. No cgroup is used (a job's user cannot in general write its
own), so the sandbox asks the OOM killer to pick it first (``oom_score_adj`` 1000, util-linux's ``choom``):
memory pressure from a run ends the run, not a training rank.

The interpreter is the system's ``/usr/bin/python3`` (the project's venv lives under the hidden ``/work``).
This module needs only the standard library and :mod:`verl.errors`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from verl.errors import InputError

_UID_BASE = 420000  # per-run uids are _UID_BASE + k: far above any account's uid, never a real user
_UID_SPAN = 50000
_uid_counter = itertools.count(os.getpid() * 97 % _UID_SPAN)
OOM_SCORE_ADJ = 1000  # the OOM killer's first choice: a run, never the rank that started it


class SandboxUnavailableError(InputError, RuntimeError):
    """The sandbox cannot run on this host (bwrap or prlimit missing, a bwrap older than 0.8 without
    ``--disable-userns``, user namespaces off, a host limit bwrap cannot start under): one line, before any
    rollout (exit 2)."""


class SandboxError(RuntimeError):
    """bwrap itself failed on one run (the program never ran); the agent loop counts it as a tool error."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 << 20
    max_processes: int = 32
    max_output_bytes: int = 64 << 10
    max_file_bytes: int = 8 << 20
    tmp_bytes: int = 32 << 20
    python: str = "/usr/bin/python3"


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool = False
    truncated: bool = False
    wall_s: float = 0.0
    sandbox_error: str | None = None
    """bwrap's own failure (the program never ran), e.g. ``bwrap: Creating new namespace failed: ...``."""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_text(self) -> str:
        """What the model reads back."""
        parts = []
        if self.stdout:
            parts.append(self.stdout)
        if self.stderr:
            parts.append(("stderr:\n" if self.stdout else "") + self.stderr)
        if self.truncated:
            parts.append("[output truncated]")
        if self.timed_out:
            parts.append("[killed: wall-clock deadline exceeded]")
        elif self.returncode not in (0, None):
            parts.append(f"[exit code {self.returncode}]")
        return "\n".join(p.rstrip("\n") for p in parts) if parts else "[no output]"


def sandbox_available() -> bool:
    """bwrap and prlimit are installed (whether they work here is :func:`check_sandbox`'s question)."""
    return shutil.which("bwrap") is not None and shutil.which("prlimit") is not None


def _root_args() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + top
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def build_command(code: str, limits: SandboxLimits, status_fd: int | None = None) -> list[str]:
    """The argv of one sandboxed run: [choom ->] bwrap -> prlimit -> python. ``status_fd``: bwrap's
    ``--json-status-fd`` (it reports the program's exit there, which tells a bwrap failure from the program's)."""
    bwrap, prlimit, choom = shutil.which("bwrap"), shutil.which("prlimit"), shutil.which("choom")
    if bwrap is None or prlimit is None:
        raise SandboxUnavailableError("the code sandbox needs bwrap and prlimit: apt-get install -y bubblewrap "
                                      "util-linux (launch/setup_env.sh installs them)")
    cpu = max(1, int(limits.cpu_seconds))
    oom = [choom, "-n", str(OOM_SCORE_ADJ), "--"] if choom else []  # choom: util-linux >= 2.33
    status = ["--json-status-fd", str(status_fd)] if status_fd is not None else []
    return [
        *oom,
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--clearenv", *status,
        *_root_args(),
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
        "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev", "--remount-ro", "/",
        "--hostname", "sandbox", "--chdir", "/tmp",
        "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--",
        # inside the new user namespace (see the module doc): the process count is this run's alone
        prlimit, f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_bytes}", f"--fsize={limits.max_file_bytes}",
        f"--nproc={limits.max_processes}", "--core=0", "--",
        limits.python, "-I", "-c", code,
    ]


async def _read_capped(stream: asyncio.StreamReader, cap: int, over: asyncio.Event) -> bytes:
    """The first ``cap`` bytes; past them ``over`` is set (the caller kills the program) and the rest is read and
    dropped until EOF: asyncio's ``Process.wait()`` returns only once every pipe is closed, and a pipe left full
    and unread never closes."""
    buf = bytearray()
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(buf)
        room = cap - len(buf)
        if len(chunk) > room:
            buf += chunk[:max(room, 0)]
            over.set()
        else:
            buf += chunk


def _kill_tree(proc: _Run) -> None:
    # choom and prlimit exec; bwrap leads the session we started, and its sandbox dies with it (PID 1 of its
    # namespace)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _drain(fd: int) -> bytes:
    """What is in the pipe now (its writers are gone or done: never blocks)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


_spawner_lock = threading.Lock()
_spawner_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _spawner() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that forks every run, alive as long as this process. bwrap's ``--die-with-parent`` is
    PR_SET_PDEATHSIG, which the kernel ties to the *thread* that forked it: forked from an event loop's thread, a
    run died whenever that thread ended, as SGLang's does at every pause of the async trainers (fault 6 of issue
    56), though the run was meant to go on. From this thread it dies with the process only."""
    global _spawner_pool
    with _spawner_lock:
        if _spawner_pool is None:
            _spawner_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sandbox-spawner")
        return _spawner_pool


class _Run:
    """A run forked by :func:`_spawner`, with what :func:`_supervise` uses of asyncio's ``Process``: ``pid``,
    ``returncode``, ``stdout`` / ``stderr`` (StreamReaders on the running loop) and ``wait()``."""

    def __init__(self, popen: subprocess.Popen, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader):
        self._popen, self.pid, self.stdout, self.stderr = popen, popen.pid, stdout, stderr

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    async def wait(self) -> int:
        delay = 0.001
        while self._popen.poll() is None:  # no thread per run: the exit is polled, at most 20 ms late
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)
        return self._popen.returncode


def _discard(popen: subprocess.Popen) -> None:
    """Kill and reap a run no caller will supervise (its start was cancelled)."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    popen.wait()
    for pipe in (popen.stdout, popen.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


async def _start(argv: list[str], status_w: int, user_kwargs: dict[str, Any]) -> _Run:
    loop = asyncio.get_running_loop()
    started = _spawner().submit(
        subprocess.Popen, argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, cwd="/", env={"PATH": "/usr/bin:/bin"}, pass_fds=(status_w,), **user_kwargs)
    try:
        popen = await asyncio.wrap_future(started)
    except asyncio.CancelledError:  # (a tool time limit) the run may still start: it is killed when it does
        started.add_done_callback(lambda f: None if f.cancelled() or f.exception() else _discard(f.result()))
        raise
    try:
        readers = []
        for pipe in (popen.stdout, popen.stderr):
            reader = asyncio.StreamReader(loop=loop)
            await loop.connect_read_pipe(lambda reader=reader: asyncio.StreamReaderProtocol(reader, loop=loop),
                                         pipe)
            readers.append(reader)
    except BaseException:
        _discard(popen)
        raise
    return _Run(popen, *readers)


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandbox and return what it printed; never raises for what the code does. A run
    that bwrap could not start carries ``sandbox_error``. Cancelling the call kills the run; the end of the
    thread running the event loop does not (:func:`_spawner`)."""
    limits = limits or SandboxLimits()
    status_r, status_w = os.pipe()
    user_kwargs: dict[str, Any] = {}
    if os.geteuid() == 0:
        uid = _UID_BASE + next(_uid_counter) % _UID_SPAN
        user_kwargs = {"user": uid, "group": uid, "extra_groups": []}
    start = time.monotonic()
    try:
        try:
            proc = await _start(build_command(code, limits, status_fd=status_w), status_w, user_kwargs)
        finally:
            os.close(status_w)
        out, err, timed_out, truncated = await _supervise(proc, limits)
        status = _drain(status_r)
    finally:
        os.close(status_r)
    result = SandboxResult(stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                           returncode=proc.returncode, timed_out=timed_out, truncated=truncated,
                           wall_s=time.monotonic() - start)
    # bwrap writes "exit-code" once the program has exited; without it (and without our kill) the program never
    # ran: a namespace, mount or exec failure of bwrap's, whose message is its stderr
    if b'"exit-code"' not in status and not (timed_out or truncated):
        lines = result.stderr.strip().splitlines()
        result.sandbox_error = lines[0] if lines else f"bwrap exited with {proc.returncode} before the program ran"
    return result


async def _supervise(proc: _Run, limits: SandboxLimits) -> tuple[bytes, bytes, bool, bool]:
    """(stdout, stderr, timed_out, truncated) of a started run; its tree is dead when this returns or raises."""
    over = asyncio.Event()
    readers = asyncio.gather(_read_capped(proc.stdout, limits.max_output_bytes, over),
                             _read_capped(proc.stderr, limits.max_output_bytes, over))
    over_wait = asyncio.ensure_future(over.wait())
    done_wait = asyncio.ensure_future(proc.wait())
    timed_out = False
    try:
        finished, _ = await asyncio.wait({done_wait, over_wait}, timeout=limits.wall_seconds,
                                         return_when=asyncio.FIRST_COMPLETED)
        if not finished:
            timed_out = True
        if done_wait not in finished:
            _kill_tree(proc)
        await proc.wait()
        # a child that kept the pipes open outlives the deadline only until the kill above
        try:
            out, err = await asyncio.wait_for(readers, timeout=2.0)
        except asyncio.TimeoutError:
            _kill_tree(proc)
            out, err = await readers
    finally:
        over_wait.cancel()
        # first, and without awaiting: a cancelled call (a tool time limit) takes its run with it even if it is
        # cancelled again below. Normally only leftovers: the PID namespace died with bwrap.
        _kill_tree(proc)
        if proc.returncode is None or not readers.done():
            # cancelled: reap it, and read its pipes to EOF so that their transports close on this loop
            await proc.wait()
            await asyncio.wait({readers}, timeout=2.0)
    return out, err, timed_out, over.is_set()


def check_sandbox(limits: SandboxLimits | None = None) -> None:
    """The start-up probe: ``print(1)`` through the real argv, from this process (its uid, its threads);
    :class:`SandboxUnavailableError` in one line when that does not print 1."""
    limits = limits or SandboxLimits()
    build_command("", limits)  # missing binaries: the install line
    # on a thread of its own: the caller may be inside a running event loop
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sandbox-probe") as pool:
        result = pool.submit(asyncio.run, run_python("print(1)", limits)).result()
    if result.returncode == 0 and result.stdout == "1\n":
        return
    if result.sandbox_error:
        why = result.sandbox_error
    elif result.timed_out:
        why = f"no answer within wall_seconds={limits.wall_seconds:g}"
    else:
        lines = result.stderr.strip().splitlines()
        why = f"exit code {result.returncode}" + (f": {lines[-1]}" if lines else "")
    raise SandboxUnavailableError(f"the code sandbox cannot run here: print(1) through bwrap failed ({why}); "
                                  "docs/security.md says what it needs")

