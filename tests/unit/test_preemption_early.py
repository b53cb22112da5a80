"""A SIGUSR1 (Slurm's time-limit / preemption signal) that reaches a rank while it is still starting is honoured
once the trainer's handler is installed, instead of killing the rank (its default action: the GPU template's job
failed with exit 138 when the signal came at start)."""

import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CHILD = """
import os, signal
from verl.launcher import preemption
preemption.hold_early_preemption()
os.kill(os.getpid(), signal.SIGUSR1)          # arrives before any handler of the trainer's
with preemption.PreemptionHandler() as handler:
    print(handler.requested, handler.received_signal == signal.SIGUSR1)
"""


def test_a_sigusr1_during_start_up_is_held_for_the_handler():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True"], proc.stderr


def test_without_holding_the_signal_kills_the_process():
    code = "import os, signal\nos.kill(os.getpid(), signal.SIGUSR1)\nprint('alive')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGUSR1 and "alive" not in proc.stdout
