"""A parent that starts ranks or stages takes them down with it, even when it is SIGKILLed (issue 14,
row 2): verl's local spawner (`verl train --nproc N`) and the quickstart's stage runner."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers.tiny_models import alive_pids

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


alive = alive_pids


def wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def kill_parent_and_check_children(parent: subprocess.Popen, sleepers: int, ready=None):
    """Wait for ``sleepers`` descendants running SLEEPER (and ``ready(descendants)``), SIGKILL the parent
    and assert that none of its descendants survives it by more than a few seconds."""
    def started():
        procs = psutil.Process(parent.pid).children(recursive=True)
        n = sum(1 for p in procs if p.cmdline()[1:] == SLEEPER[1:])
        return procs if n == sleepers and (ready is None or ready(procs)) else None

    descendants = []
    try:
        descendants = [p.pid for p in wait_for(started, 60, f"{sleepers} children")]
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        left = wait_for(lambda: not alive(descendants) or None, 5, "the children to die") and []
        assert not left
    except AssertionError:
        survivors = alive(descendants)
        raise AssertionError(f"children of the killed parent still running: {survivors}") from None
    finally:
        for pid in alive(descendants):  # only the processes this test started
            os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


def _env():
    return {**os.environ, "PYTHONPATH": REPO}


def test_spawn_local_ranks_die_with_a_killed_launcher():
    parent = subprocess.Popen([sys.executable, "-m", "verl.launcher.spawn", "--nproc", "2", "--", *SLEEPER],
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_parent_and_check_children(parent, sleepers=2)


@pytest.mark.parametrize("nested", [False, True], ids=["stage", "stage-launcher-ranks"])
def test_quickstart_stage_dies_with_a_killed_driver(tmp_path, nested):
    """The quickstart's stage runner; nested: its stage is a launcher with 2 ranks (what `verl train` is)."""
    stage = ([sys.executable, "-m", "verl.launcher.spawn", "--nproc", "2", "--", *SLEEPER] if nested else SLEEPER)
    driver = textwrap.dedent(f"""
        import os
        from launch.quickstart import Console, run_stage
        run_stage(Console(), "stage", {stage!r}, {str(tmp_path / "stage.log")!r}, dict(os.environ))
    """)
    parent = subprocess.Popen([sys.executable, "-c", driver], env=_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    kill_parent_and_check_children(parent, sleepers=2 if nested else 1)


def test_quickstart_stage_is_stopped_when_the_driver_raises(tmp_path):
    """An exception in the driver's loop (here: its progress poll) stops the stage before it propagates."""
    pid_file = str(tmp_path / "child.pid")
    child_code = f"import os, time; open({pid_file!r}, 'w').write(str(os.getpid())); print('go', flush=True); " \
                 "time.sleep(600)"
    driver = textwrap.dedent(f"""
        import os, sys
        from launch import quickstart
        def poll():
            raise RuntimeError("poll failed")
        try:
            quickstart.run_stage(quickstart.Console(), "stage", [sys.executable, "-c", {child_code!r}],
                                 {str(tmp_path / "s.log")!r}, dict(os.environ), poll=poll)
        except RuntimeError:
            with open({pid_file!r}) as fh:
                pid = int(fh.read())
            os.kill(pid, 0)  # raises when the child is gone (reaped by run_stage)
            print("child still running", flush=True)
            os.kill(pid, 9)
    """)
    result = subprocess.run([sys.executable, "-c", driver], env=_env(), cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert "ProcessLookupError" in result.stderr and "child still running" not in result.stdout, result.stderr
