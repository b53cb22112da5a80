"""SIGHUP (a closed terminal, a lost ssh session) is a preemption like SIGTERM: the ranks finish the step,
checkpoint and exit 0, unless the run was started under nohup (SIGHUP ignored: it stays ignored)."""

import os
import pty
import signal
import subprocess
import sys
import textwrap
import time

from verl.launcher.preemption import DEFAULT_SIGNALS, TRAINER_SIGNALS
from verl.launcher.spawn import LocalRanks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = textwrap.dedent("""
    import os, signal
    from verl.launcher.preemption import PreemptionHandler
    with PreemptionHandler() as preempt:
        os.kill(os.getpid(), signal.SIGHUP)
        print(preempt.requested, preempt.received_signal)
""")


def run_probe(preexec=None):
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO), preexec_fn=preexec)


def test_sighup_requests_a_checkpointed_stop_like_sigterm():
    assert signal.SIGHUP in DEFAULT_SIGNALS and set(DEFAULT_SIGNALS) <= set(TRAINER_SIGNALS)
    assert signal.SIGINT in TRAINER_SIGNALS
    proc = run_probe()
    assert proc.returncode == 0, f"SIGHUP killed the process (exit {proc.returncode}): {proc.stderr[-2000:]}"
    assert proc.stdout.split() == ["True", str(int(signal.SIGHUP))]


def test_under_nohup_sighup_stays_ignored():
    proc = run_probe(preexec=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "None"]


class GoneTerminal:
    """A stream whose writes fail as a hung-up terminal's do."""

    def write(self, text):
        raise OSError(5, "Input/output error")

    def flush(self):
        raise OSError(5, "Input/output error")


def test_rank_output_is_drained_when_the_terminal_is_gone():
    # 400 KB of output: far past a pipe's 64 KB, so an undrained rank blocks and meets the deadline (124).
    ranks = LocalRanks(1, [sys.executable, "-c", "for _ in range(4000): print('x' * 99)"], out=GoneTerminal())
    assert ranks.wait(timeout_s=30) == 0


RANK = textwrap.dedent("""
    import os, sys, time
    from verl.launcher.preemption import PreemptionHandler
    with PreemptionHandler() as preempt:
        print("ready", flush=True)
        while not preempt.requested:
            time.sleep(0.05)
        for _ in range(2000):  # the last step's output, to a terminal that is gone
            print("y" * 99)
        with open(sys.argv[1], "w") as f:
            f.write(str(preempt.received_signal))
""")


def test_a_closed_terminal_checkpoints_the_ranks_and_the_launcher_exits_0(tmp_path):
    """The launcher's terminal hangs up: SIGHUP to the launcher (forwarded to the ranks), its writes fail."""
    master, slave = pty.openpty()
    marker = tmp_path / "checkpoint"
    launcher = subprocess.Popen([sys.executable, "-m", "verl.launcher.spawn", "--nproc", "2", "--",
                                 sys.executable, "-c", RANK, str(marker)],
                                cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), stdin=subprocess.DEVNULL,
                                stdout=slave, stderr=slave)
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 60
    while seen.count(b"ready") < 2 and time.monotonic() < deadline:
        seen += os.read(master, 4096)
    assert seen.count(b"ready") == 2, seen
    os.close(master)  # the terminal is gone: writes to it fail from now on
    launcher.send_signal(signal.SIGHUP)
    code = launcher.wait(timeout=60)
    assert code == 0, f"the launcher exited {code} after SIGHUP"
    assert marker.read_text() == str(int(signal.SIGHUP))
