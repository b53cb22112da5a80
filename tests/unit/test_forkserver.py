"""Ranks forked from the fork server (verl.launcher.forkserver) behave as ranks started fresh: their own
variables and output lines, exit codes (a signal's as -signal), signals forwarded by the launcher, nohup's ignored
SIGHUP, no rank outliving a killed launcher; VERL_RANK_START=exec starts them fresh. The launcher runs in a
subprocess of its own (pytest's process is not what `verl train` forks from)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers.tiny_models import alive_pids

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)

LAUNCHER = textwrap.dedent("""
    import sys
    from verl.launcher.forkserver import ForkServer
    from verl.launcher.spawn import spawn_local

    server = ForkServer.start(["helpers.forked_rank"], optional=("json.tool", "no_such_module_here"))
    print("server", "yes" if server else "no", flush=True)
    failure = {}
    try:
        code = spawn_local(int(sys.argv[1]), [sys.executable, "-m", "helpers.forked_rank", *sys.argv[2:]],
                           failure=failure, forkserver=server)
    finally:
        if server is not None:
            server.close()
    print("exit", code, "failure", failure, flush=True)
""")


def launcher(nproc, *argv, env=None, **popen):
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, REPO]), "FORKED_RANK_MARKER": "m1", **(env or {})}
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(nproc), *argv], cwd=REPO, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def run(nproc, *argv, env=None):
    proc = launcher(nproc, *argv, env=env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return out


def test_forked_ranks_get_their_variables_output_lines_and_preloaded_modules():
    out = run(2, "exit", "0")
    assert "server yes" in out, out
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank}/2 pid " in out, out
        assert f"[rank {rank}] rank {rank}/2" in out and "marker m1 preloaded True" in out, out
    assert "exit 0 failure {}" in out, out


def test_fresh_interpreters_with_verl_rank_start_exec():
    out = run(2, "exit", "0", env={"VERL_RANK_START": "exec"})
    assert "server no" in out and "preloaded False" in out and "preloaded True" not in out, out


def test_a_failing_forked_rank_sets_the_exit_code():
    out = run(1, "exit", "3")
    assert "exit 3 failure {'rank': 0, 'signal': None}" in out, out


def _rank_pids(out_lines):
    return [int(line.split(" pid ")[1].split()[0]) for line in out_lines if " pid " in line]


def _read_until(proc, count, word="ready"):
    lines, deadline = [], time.monotonic() + 60
    while sum(word in line for line in lines) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    assert sum(word in line for line in lines) == count, lines
    return lines


def test_a_rank_killed_by_a_signal_reads_as_killed():
    proc = launcher(2, "sleep")
    try:
        lines = _read_until(proc, 2)
        os.kill(_rank_pids(lines)[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert "exit 137 failure {'rank': " in out and "'signal': 9}" in out, out
        assert not alive_pids(_rank_pids(lines)), "a rank outlived the failed job"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_the_launcher_forwards_signals_to_forked_ranks(signum):
    proc = launcher(2, "wait")
    try:
        _read_until(proc, 2)
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=60)
        assert out.count(f"got {int(signum)}") == 2 and "exit 0 failure {}" in out, out
    finally:
        proc.kill()
        proc.wait()


def test_sighup_stays_ignored_under_nohup():
    proc = launcher(1, "sighup", preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    out, _ = proc.communicate(timeout=120)
    assert "server yes" in out and "sighup ignored" in out, out
    assert "sighup default" in run(1, "sighup"), "a rank not under nohup must die of SIGHUP"


def test_no_forked_rank_outlives_a_killed_launcher():
    proc = launcher(2, "sleep")
    pids = []
    try:
        pids = _rank_pids(_read_until(proc, 2))
        server = [p.pid for p in psutil.Process(proc.pid).children() if p.pid not in pids]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive_pids(pids + server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive_pids(pids + server), f"outlived the launcher: {alive_pids(pids + server)}"
    finally:
        for pid in alive_pids(pids):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_no_fork_on_a_gpu_host_with_a_second_python_thread_or_when_switched_off(monkeypatch, tmp_path):
    import threading

    from verl.launcher import forkserver

    assert forkserver.fork_allowed({})
    assert not forkserver.fork_allowed({"VERL_RANK_START": "exec"})
    (tmp_path / "nvidiactl").write_text("")
    monkeypatch.setattr(forkserver, "GPU_DEVICE_NODES", (str(tmp_path / "nvidiactl"),))
    assert not forkserver.fork_allowed({}), "a CUDA driver touched by an import does not survive fork"
    monkeypatch.undo()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert forkserver.ForkServer.start(["json"]) is None
    finally:
        stop.set()
        thread.join()
