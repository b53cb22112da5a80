"""Readers of metrics.jsonl (a file the trainer appends to): a cut last line is skipped, a bad line in
the middle is one error naming the file and line (issue 14, rows 1 and 3)."""

import json
import logging
import os
import subprocess
import sys

import pytest

from launch.quickstart import _read as quickstart_read
from verl.utils.tracking import MetricsError, Tracking, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(path, records, tail=b""):
    with open(path, "wb") as fh:
        for r in records:
            fh.write((json.dumps(r) + "\n").encode())
        fh.write(tail)


RECORDS = [{"step": s, "critic/score/mean": 0.1 * s, "response_length/mean": 10.0 + s} for s in (1, 2, 3)]
CUT = b'{"step": 4, "critic/score/mean": 0.4, "respo'  # what kill -9 during a write leaves


def test_cut_last_line_is_skipped_with_one_warning(tmp_path, caplog):
    path = str(tmp_path / "metrics.jsonl")
    _write(path, RECORDS, CUT)
    with caplog.at_level(logging.WARNING, logger="verl.utils.tracking"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    warnings = [r for r in caplog.records if "last line 4" in r.getMessage()]
    assert len(warnings) == 1 and path in warnings[0].getMessage()


def test_live_reader_skips_silently(tmp_path, caplog):
    path = str(tmp_path / "metrics.jsonl")
    _write(path, RECORDS, CUT)
    with caplog.at_level(logging.WARNING, logger="verl.utils.tracking"):
        assert [r["step"] for r in quickstart_read(path, live=True)] == [1, 2, 3]
    assert not caplog.records


@pytest.mark.parametrize("bad", [b'{"step": 2, "x": 1,, }', b"\xff\xfe not utf-8", b'[1, 2]', b'{"no_step": 1}'])
def test_corrupt_middle_line_names_file_and_line(tmp_path, bad):
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "wb") as fh:
        fh.write(b'{"step": 1}\n' + bad + b'\n{"step": 3}\n')
    with pytest.raises(MetricsError, match=rf"{path}, line 2: expected a JSON object"):
        read_metrics(path)


def test_tracking_resumes_after_a_cut_line(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    _write(path, RECORDS[:2], CUT)
    tracker = Tracking(str(tmp_path), backends=())
    tracker.log({"critic/score/mean": 0.3}, step=3)
    tracker.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    with open(path, "rb") as fh:
        assert fh.read().endswith(b"\n")


def _plot(*args):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "verl.cli", "plot", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)


def test_verl_plot_cut_last_line_plots(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    _write(path, RECORDS, CUT)
    result = _plot(path, "--out", str(tmp_path / "m.png"))
    assert result.returncode == 0, result.stderr
    assert os.path.getsize(tmp_path / "m.png") > 0
    assert "3 steps" in result.stdout
    assert result.stderr.count("last line 4") == 1 and "Traceback" not in result.stderr


def test_verl_plot_corrupt_middle_line_exits_2(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    _write(path, RECORDS[:1], b'{"step": 2, "a": \n' + (json.dumps(RECORDS[2]) + "\n").encode())
    result = _plot(path, "--out", str(tmp_path / "m.png"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{path}, line 2" in lines[0], result.stderr
    assert not os.path.exists(tmp_path / "m.png")
