"""Run model-written Python in a sandbox, and the ``code_interpreter`` tool on top of it.

Each run is one ``bwrap`` (bubblewrap, Debian's ``bubblewrap`` package) process tree with:

* its own user, mount, PID, network, IPC and UTS namespaces (``--unshare-all``): no network interface but
  loopback, no view of the host's processes; it dies with its parent (``--die-with-parent``) and killing it
  kills everything it started (PID 1 of its namespace);
* a root made only of the host's ``/usr`` read-only (plus the merged-usr links ``/bin``, ``/lib``...): the
  project, ``/work``, ``$HOME``, ``/etc`` and ``/root`` are simply not there; ``/tmp`` and ``/dev/shm`` are
  private tmpfs of a fixed size (the disk cannot be filled), ``/dev`` is read-only;
* rlimits (``prlimit``) on CPU seconds, address space, file size and processes. When we run as root the run
  also drops to a uid of its own (``RLIMIT_NPROC`` does not bind root, and a per-run uid keeps concurrent
  runs from sharing one process budget), so a fork bomb stops at ``max_processes``;
* a wall-clock deadline: past it the tree is killed and the result says ``timed_out``; stdout and stderr are
  each kept to ``max_output_bytes`` (a run that prints more is killed and marked ``truncated``).

The interpreter is the system's ``/usr/bin/python3`` (the project's venv lives under the hidden ``/work``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

_UID_BASE = 420000  # per-run uids are _UID_BASE + k: far above any account's uid, never a real user
_UID_SPAN = 50000
_uid_counter = itertools.count(os.getpid() * 97 % _UID_SPAN)


class SandboxUnavailableError(RuntimeError):
    """bwrap (or prlimit) is not installed or user namespaces are off: install bubblewrap (launch/setup_env.sh)."""


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


def build_command(code: str, limits: SandboxLimits) -> list[str]:
    """The argv of one sandboxed run (prlimit -> bwrap -> python)."""
    bwrap, prlimit = shutil.which("bwrap"), shutil.which("prlimit")
    if bwrap is None or prlimit is None:
        raise SandboxUnavailableError("the code sandbox needs bwrap and prlimit: apt-get install -y bubblewrap "
                                      "util-linux (launch/setup_env.sh installs them)")
    cpu = max(1, int(limits.cpu_seconds))
    return [
        prlimit, f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_bytes}", f"--fsize={limits.max_file_bytes}",
        f"--nproc={limits.max_processes}", "--core=0", "--",
        bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
        *_root_args(),
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
        "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev", "--remount-ro", "/",
        "--hostname", "sandbox", "--chdir", "/tmp",
        "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
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


def _kill_tree(proc: asyncio.subprocess.Process) -> None:
    # prlimit execs bwrap in the session we started; its sandbox dies with it (PID 1 of its namespace)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandbox and return what it printed; never raises for what the code does."""
    limits = limits or SandboxLimits()
    argv = build_command(code, limits)
    user_kwargs: dict[str, Any] = {}
    if os.geteuid() == 0:
        uid = _UID_BASE + next(_uid_counter) % _UID_SPAN
        user_kwargs = {"user": uid, "group": uid, "extra_groups": []}
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, cwd="/", env={"PATH": "/usr/bin:/bin"}, **user_kwargs)
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
        if proc.returncode is None:
            _kill_tree(proc)
            await proc.wait()
        _kill_tree(proc)  # leftovers in the session (none normally: the PID namespace died with bwrap)
    return SandboxResult(stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                         returncode=proc.returncode, timed_out=timed_out, truncated=over.is_set(),
                         wall_s=time.monotonic() - start)


class CodeInterpreterTool(BaseTool):
    """``code_interpreter(code)``: runs the model's Python in the sandbox and returns its output.

    ``config`` keys (all optional): the fields of :class:`SandboxLimits` (``wall_seconds``, ``cpu_seconds``,
    ``memory_bytes``, ``max_processes``, ``max_output_bytes``, ``max_file_bytes``, ``tmp_bytes``, ``python``)
    and ``max_concurrency`` (sandboxes of this tool running at once; default 4).
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        fields = set(SandboxLimits.__dataclass_fields__)
        unknown = set(self.config) - fields - {"type", "max_concurrency"}
        if unknown:
            raise ValueError(f"code_interpreter config: unknown keys {sorted(unknown)} (known: {sorted(fields)})")
        self.limits = SandboxLimits(**{k: v for k, v in self.config.items() if k in fields})
        if not sandbox_available():
            raise SandboxUnavailableError("code_interpreter needs bubblewrap: apt-get install -y bubblewrap")
        self._slots = asyncio.Semaphore(int(self.config.get("max_concurrency", 4)))

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {"name": "code_interpreter",
                         "description": "Run a Python program and return what it prints (no network, no files "
                                        "kept between calls).",
                         "parameters": {"type": "object", "required": ["code"], "properties": {
                             "code": {"type": "string", "description": "Python source; print the answer."}}}}})

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: 'code' must be a non-empty string"), 0.0, {"error": 1}
        async with self._slots:
            result = await run_python(code, self.limits)
        metrics = {"timed_out": int(result.timed_out), "returncode": result.returncode, "wall_s": result.wall_s}
        return ToolResponse(text=result.as_text()), 0.0, metrics
