"""The code sandbox (bubblewrap): no project files or home, no network, fork bombs and disk filling contained,
output capped, a hung program killed at its deadline while the trajectory goes on; as an unprivileged user with
a rank's threads (issue 56), no nested user namespace, the OOM killer's first pick, a start-up probe that refuses
in one line, a bwrap failure counted as a tool error, the concurrency limit across event loops, and a run cut by
``multi_turn.tool_timeout_s`` killed."""

import asyncio
import json
import logging
import os
import shutil
import subprocess
import tempfile
import textwrap
import time
import uuid

import pytest

from verl import errors
from verl.errors import InputError
from verl.tools import code_interpreter, sandbox
from verl.tools.code_interpreter import CodeInterpreterTool
from verl.tools.sandbox import (
    SandboxLimits,
    SandboxUnavailableError,
    check_sandbox,
    run_python,
    sandbox_available,
)

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not sandbox_available(), reason="bubblewrap not installed (launch/setup_env.sh)")]

LIMITS = SandboxLimits(wall_seconds=4, cpu_seconds=3)


def run(code, limits=LIMITS):
    return asyncio.run(run_python(code, limits))


def test_runs_code_and_hides_project_and_home(tmp_path):
    assert run("print(6 * 7)").stdout == "42\n"
    here = os.path.abspath(__file__)
    home = os.path.expanduser("~")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    code = ("import os\n"
            f"for p in [{here!r}, {home!r}, '/work', {str(secret)!r}, '/etc/passwd', '/root']:\n"
            "    print(p, os.path.exists(p))\n"
            "print(sorted(os.listdir('/')))\n"
            "print(os.getpid())\n")
    out = run(code).stdout.splitlines()
    assert all(line.endswith(" False") for line in out[:6]), out
    assert out[6] == "['bin', 'dev', 'lib', 'lib64', 'proc', 'sbin', 'tmp', 'usr']" or "work" not in out[6]
    assert int(out[7]) < 10  # its own PID namespace
    r = run("open('/usr/evil', 'w')")
    assert "Read-only file system" in r.stderr


def test_no_network():
    r = run("import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))")
    assert r.returncode != 0 and "Network is unreachable" in r.stderr
    r = run("import socket\nprint(socket.if_nameindex())")
    assert "eth" not in r.stdout and "ens" not in r.stdout


def test_fork_bomb_is_contained():
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
            "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('stopped', n, e.errno)\n")
    t0 = time.monotonic()
    r = run(code, SandboxLimits(wall_seconds=4, max_processes=16))
    assert r.stdout.startswith("stopped") and int(r.stdout.split()[1]) < 16
    assert time.monotonic() - t0 < 20  # the children sleep 30 s: they died with the sandbox, not after


def test_disk_cannot_be_filled_and_output_is_capped():
    r = run("open('/tmp/big', 'wb').write(b'0' * (64 << 20))", SandboxLimits(max_file_bytes=8 << 20))
    assert "File too large" in r.stderr
    code = "for i in range(100):\n    open(f'/tmp/f{i}', 'wb').write(b'0' * (1 << 20))"
    r = run(code, SandboxLimits(max_file_bytes=8 << 20, tmp_bytes=16 << 20))
    assert "No space left on device" in r.stderr
    r = run("print('x' * 10**7)", SandboxLimits(max_output_bytes=1000))
    assert r.truncated and len(r.stdout) == 1000 and "[output truncated]" in r.as_text()
    r = run("x = bytearray(4 << 30)", SandboxLimits(memory_bytes=256 << 20))
    assert "MemoryError" in r.stderr


def test_hung_program_ends_at_deadline_and_the_trajectory_goes_on():
    from test_agent_loop import CHATML, ScriptedServerManager, call, char_tokenizer, make_loop

    tool = CodeInterpreterTool({"type": "native", "wall_seconds": 1.5, "cpu_seconds": 10})
    tok = char_tokenizer(CHATML)
    server = ScriptedServerManager(tok, [call("code_interpreter", code="import time\ntime.sleep(60)") + "<|im_end|>",
                                         call("code_interpreter", code="print(2**100)") + "<|im_end|>",
                                         "done<|im_end|>"])
    t0 = time.monotonic()
    out = asyncio.run(make_loop(tok, server, [tool], response_length=2000).run(
        {}, raw_prompt=[{"role": "user", "content": "go"}]))
    assert time.monotonic() - t0 < 30  # the hung program sleeps 60 s: it was ended at its 1.5 s deadline
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    assert "[killed: wall-clock deadline exceeded]" in text and str(2 ** 100) in text
    assert text.endswith("done<|im_end|>")
    assert out.num_turns == 6
    with pytest.raises(ValueError, match="unknown keys"):
        CodeInterpreterTool({"type": "native", "wall_secs": 1})
    from verl.tools.tool_registry import get_tool_class

    # a tool YAML's former class_name still loads
    assert get_tool_class("verl.tools.sandbox.CodeInterpreterTool") is CodeInterpreterTool


FORK_BOMB = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
             "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('stopped', n, e.errno)\n")
UNSHARE = ("import subprocess\nr = subprocess.run(['unshare', '--user', 'true'], capture_output=True, text=True)\n"
           "print(r.returncode, r.stderr.strip())")

# Run by an unprivileged user with the system's python3 and only the sandbox's own module: the project's venv may
# be unreadable to that user (a pyenv interpreter under /root), which is irrelevant to what is tested.
UNPRIVILEGED = textwrap.dedent("""
    import asyncio, json, threading
    from verl.tools.sandbox import SandboxLimits, check_sandbox, run_python

    hold = threading.Event()
    for _ in range(48):  # a training rank has dozens of threads; before the fix 32 processes counted them all
        threading.Thread(target=hold.wait, daemon=True).start()
    limits = SandboxLimits(wall_seconds=10, cpu_seconds=5, max_processes=16)
    check_sandbox(limits)
    report = {{"threads": threading.active_count()}}
    for name, code, wall in [("first", "print(6 * 7)", 10), ("second", "print(6 * 7)", 10),
                             ("fork_bomb", {fork_bomb!r}, 10), ("unshare", {unshare!r}, 10),
                             ("deadline", "import time\\ntime.sleep(60)", 1.5)]:
        r = asyncio.run(run_python(code, SandboxLimits(wall_seconds=wall, cpu_seconds=5, max_processes=16)))
        report[name] = {{"stdout": r.stdout, "stderr": r.stderr, "timed_out": r.timed_out,
                         "sandbox_error": r.sandbox_error}}
    print(json.dumps(report))
""").format(fork_bomb=FORK_BOMB, unshare=UNSHARE)


def _readable_copy_of_the_sandbox() -> str:
    """verl/errors.py and verl/tools/sandbox.py in a fresh world-readable directory (the checkout may not be)."""
    tree = tempfile.mkdtemp(prefix="verl-sandbox-nonroot-")
    os.chmod(tree, 0o755)
    for sub in ("verl", "verl/tools"):
        os.makedirs(os.path.join(tree, sub), mode=0o755)
        os.chmod(os.path.join(tree, sub), 0o755)
        open(os.path.join(tree, sub, "__init__.py"), "w").close()
    shutil.copy(sandbox.__file__, os.path.join(tree, "verl", "tools", "sandbox.py"))
    shutil.copy(errors.__file__, os.path.join(tree, "verl", "errors.py"))
    for root, _, files in os.walk(tree):
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return tree


def test_works_as_an_unprivileged_user_with_a_ranks_threads():
    python = SandboxLimits().python
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) is not installed: cannot run as an unprivileged user")
        prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    else:
        prefix = []  # already unprivileged
    tree = _readable_copy_of_the_sandbox()
    try:
        proc = subprocess.run([*prefix, python, "-c", UNPRIVILEGED], capture_output=True, text=True, cwd=tree,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": tree}, timeout=300)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["threads"] > 40
    assert report["first"]["stdout"] == report["second"]["stdout"] == "42\n", report
    bomb = report["fork_bomb"]
    assert bomb["stdout"].startswith("stopped") and int(bomb["stdout"].split()[1]) < 16, bomb
    code, message = report["unshare"]["stdout"].split(" ", 1)
    assert int(code) != 0 and "unshare failed" in message, report["unshare"]
    assert report["deadline"]["timed_out"] and report["deadline"]["sandbox_error"] is None


def test_no_nested_user_namespace_and_the_oom_killer_picks_the_run():
    r = run(UNSHARE)
    code, message = r.stdout.split(" ", 1)
    assert int(code) != 0 and "unshare failed" in message, r
    assert run("print(open('/proc/self/oom_score_adj').read().strip())").stdout == "1000\n"


def _broken_bwrap(monkeypatch):
    # a source path that does not exist: bwrap fails before the program runs, as it does on EAGAIN
    monkeypatch.setattr(sandbox, "_root_args", lambda: ["--ro-bind", "/nonexistent-verl-sandbox-test", "/usr"])


def test_start_up_probe_refuses_in_one_line(monkeypatch):
    check_sandbox(LIMITS)  # works here
    with pytest.raises(SandboxUnavailableError) as err:
        check_sandbox(SandboxLimits(python="/nonexistent/python3"))
    assert isinstance(err.value, InputError) and "\n" not in str(err.value)
    assert "print(1) through bwrap failed (exit code" in str(err.value)
    _broken_bwrap(monkeypatch)
    with pytest.raises(SandboxUnavailableError, match="bwrap: Can't find source path") as err:
        CodeInterpreterTool({"type": "native"})
    assert "\n" not in str(err.value)


def test_a_bwrap_failure_is_a_counted_and_logged_tool_error(monkeypatch, caplog):
    from test_agent_loop import CHATML, ScriptedServerManager, call, char_tokenizer, make_loop

    tool = CodeInterpreterTool({"type": "native"})
    _broken_bwrap(monkeypatch)  # after the probe: a failure that starts mid-run (the rank's threads grew)
    tok = char_tokenizer(CHATML)
    server = ScriptedServerManager(tok, [call("code_interpreter", code="print(1)") + "<|im_end|>", "done<|im_end|>"])
    with caplog.at_level(logging.WARNING):
        out = asyncio.run(make_loop(tok, server, [tool], response_length=2000).run(
            {}, raw_prompt=[{"role": "user", "content": "go"}]))
    assert (out.extra_fields["tool_call_counts"], out.extra_fields["tool_call_errors"]) == (1, 1)
    assert "SandboxError: bwrap: Can't find source path" in tok.decode(out.response_ids, skip_special_tokens=False)
    assert any("code_interpreter" in r.getMessage() and "bwrap:" in r.getMessage() for r in caplog.records)


def test_concurrency_limit_holds_across_event_loops(monkeypatch):
    tool = CodeInterpreterTool({"type": "native", "max_concurrency": 1})
    running, peak = 0, 0

    async def counted(code, limits):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            return await run_python(code, limits)
        finally:
            running -= 1

    monkeypatch.setattr(code_interpreter, "run_python", counted)

    async def three_at_once():  # the guard only turns a hang (a semaphore of another loop) into a failure
        return await asyncio.wait_for(asyncio.gather(*(tool.execute("i", {"code": f"print({i})"}) for i in range(3))),
                                      120)

    for _ in range(2):  # two generations, each its own asyncio.run, each contended
        assert [resp.text for resp, _, _ in asyncio.run(three_at_once())] == ["0", "1", "2"]
    assert peak == 1


def _processes_with(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_tool_timeout_ends_the_call_and_kills_its_run():
    from test_agent_loop import CHATML, ScriptedServerManager, call, char_tokenizer, make_loop

    marker = f"verl-tool-timeout-{uuid.uuid4().hex}"
    tool = CodeInterpreterTool({"type": "native", "wall_seconds": 300, "cpu_seconds": 100})
    tok = char_tokenizer(CHATML)
    code = f"import time\nprint({marker!r}, flush=True)\ntime.sleep(300)"
    server = ScriptedServerManager(tok, [call("code_interpreter", code=code) + "<|im_end|>", "done<|im_end|>"])
    out = asyncio.run(make_loop(tok, server, [tool], response_length=2000, tool_timeout_s=1).run(
        {}, raw_prompt=[{"role": "user", "content": "go"}]))
    assert "did not finish within 1 s" in tok.decode(out.response_ids, skip_special_tokens=False)
    assert out.extra_fields["tool_call_errors"] == 1
    deadline = time.monotonic() + 60  # the kill is asynchronous; only a run left alive keeps this loop going
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []


def test_a_run_in_flight_survives_the_end_of_its_event_loops_thread():
    """Issue 56, fault 6: SGLang's event loop runs on a thread that ends at every pause of the async trainers; a
    run forked from that thread was SIGKILLed then (bwrap's --die-with-parent follows the forking thread), though
    its trajectory was to go on after the pause. The loop is run on one thread until the run has started, that
    thread ends, and the loop resumes on another: the run finishes and prints."""
    import threading

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(sandbox.run_python("import time\ntime.sleep(0.8)\nprint('done')", LIMITS))

        def until_started():
            loop.run_until_complete(asyncio.sleep(0.4))

        first = threading.Thread(target=until_started)
        first.start()
        first.join()
        time.sleep(0.3)  # the loop's first thread is gone, the run still sleeping
        second = threading.Thread(target=lambda: loop.run_until_complete(task))
        second.start()
        second.join(timeout=30)
        result = task.result()
    finally:
        loop.close()
    assert (result.stdout, result.returncode, result.sandbox_error) == ("done\n", 0, None), result
