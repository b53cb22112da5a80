"""launch/preemption_lead.py: the checkpoint lead before a Slurm time limit, from a run's measured times."""

import json
import os
import subprocess
import sys

import pytest

from launch.preemption_lead import lead_seconds, measured_worst

pytestmark = pytest.mark.unit
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return str(path)


def test_lead_covers_a_save_in_progress_one_step_and_the_requested_save(tmp_path):
    path = write(tmp_path / "metrics.jsonl", [
        {"step": 1, "timing_s/step": 40.0}, {"step": 2, "timing_s/step": 55.5, "timing_s/save_checkpoint": 120.0},
        {"step": 3, "timing_s/step": 41.0}])
    assert measured_worst(path) == (55.5, 120.0)
    assert lead_seconds(path, minimum=0, margin=60, factor=1.5) == 504  # ceil(1.5 * (55.5 + 240) + 60)
    assert lead_seconds(path, minimum=900, margin=60, factor=1.5) == 900  # the header's lead is the floor


def test_nothing_measured_gives_the_minimum_and_a_torn_line_is_skipped(tmp_path):
    assert lead_seconds(str(tmp_path / "missing.jsonl"), minimum=120, margin=60, factor=1.5) == 120
    assert lead_seconds("", minimum=0, margin=60, factor=1.5) == 0
    path = write(tmp_path / "metrics.jsonl", [{"step": 1, "timing_s/step": 10.0}, ["not", "a", "record"],
                                              {"timing_s/step": float("nan")}, {"timing_s/step": "9"}],
                 tail='{"step": 2, "timing_s/step": 99')  # killed mid-write
    assert measured_worst(path) == (10.0, 0.0)


def test_command_line_prints_the_lead_and_refuses_a_factor_below_one(tmp_path):
    path = write(tmp_path / "metrics.jsonl", [{"timing_s/step": 2.0, "timing_s/save_checkpoint": 4.0}])
    script = os.path.join(REPO, "launch", "preemption_lead.py")
    proc = subprocess.run([sys.executable, script, "--metrics", path, "--margin", "1", "--factor", "1"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "11", proc.stderr
    proc = subprocess.run([sys.executable, script, "--factor", "0.5"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--factor: expected >= 1, found 0.5" in proc.stderr
