"""The run timeline (`verl/utils/timeline.py`): one line per step, a rewritten step keeps its last line (a resumed
run), busy fractions count overlaps once, and `verl plot --timeline` draws it or refuses bad input with exit 2."""

import json

import pytest

from verl.utils.plotting import main as plot_main
from verl.utils.timeline import TIMELINE_FILE, TRAINER_LANE, Timeline, lane_busy_fractions, pool_lane, read_timeline

pytestmark = pytest.mark.unit


def _write_run(directory):
    timeline = Timeline(str(directory))
    for step in (1, 2, 3):
        base = 10.0 * step
        timeline.add(TRAINER_LANE, "step", base, base + 9)  # the whole step: not a phase of its own
        timeline.add(TRAINER_LANE, "gen", base, base + 2)
        timeline.add(TRAINER_LANE, "update_actor", base + 2, base + 8)
        timeline.add(pool_lane(0), "generate", base + 1, base + 7)
        timeline.write(step)
    timeline.write(4)  # nothing recorded: no line
    return timeline


def test_steps_are_written_once_each_and_a_rewritten_step_keeps_its_last_line(tmp_path):
    _write_run(tmp_path)
    resumed = Timeline(str(tmp_path))  # a resumed run redoes step 3
    resumed.add(TRAINER_LANE, "update_actor", 100.0, 101.0)
    resumed.write(3)
    timeline = read_timeline(str(tmp_path))
    assert sorted(timeline) == [1, 2, 3]
    assert timeline[3] == [(TRAINER_LANE, "update_actor", 100.0, 101.0)]
    assert all(phase != "step" for _, phase, _, _ in timeline[1])
    assert len(timeline[2]) == 3


def test_busy_fractions_count_overlapping_spans_once():
    spans = [("a", "gen", 0.0, 4.0), ("a", "gen", 2.0, 6.0), ("a", "other", 6.0, 10.0), ("b", "gen", 5.0, 7.5)]
    busy = lane_busy_fractions(spans, {"a": ["gen"], "b": ["gen"]})
    assert busy == pytest.approx({"a": 0.6, "b": 0.25})


def test_verl_plot_timeline_draws_and_refuses_bad_input(tmp_path, capsys):
    _write_run(tmp_path)
    out = tmp_path / "t.png"
    assert plot_main([str(tmp_path), "--timeline", "--out", str(out), "--steps", "2:3"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_main([str(tmp_path / "metrics.jsonl"), "--timeline", "--out", str(out)]) == 0  # the run's file
    for steps in ("3:2", "x", "7:9"):
        assert plot_main([str(tmp_path), "--timeline", "--out", str(tmp_path / "bad.png"), "--steps", steps]) == 2
        assert "expected" in capsys.readouterr().err
    assert not (tmp_path / "bad.png").exists()
    (tmp_path / "empty").mkdir()
    assert plot_main([str(tmp_path / "empty"), "--timeline", "--out", str(out)]) == 2
    with open(tmp_path / TIMELINE_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": 9, "spans": [["trainer", "gen", 1.0]]}) + "\n")
    assert plot_main([str(tmp_path), "--timeline", "--out", str(out)]) == 2
    assert "[lane, phase, start, end]" in capsys.readouterr().err
