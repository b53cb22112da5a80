"""The code sandbox (bubblewrap): no project files or home, no network, fork bombs and disk filling contained,
output capped, a hung program killed at its deadline while the trajectory goes on."""

import asyncio
import os
import time

import pytest

from verl.tools.sandbox import CodeInterpreterTool, SandboxLimits, run_python, sandbox_available

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
