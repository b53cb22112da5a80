"""`verl bench train` (issue 17): one command, one JSON record of s/step, phase split, tokens/s and peak RSS."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from helpers.train_runs import assert_same_run_on_both_paths, read_metrics  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_train_reports_steps_phases_tokens_and_memory(tmp_path):
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, "-m", "verl.cli", "bench", "train", "--steps", "2", "--warmup", "1",
                           "--workdir", str(tmp_path / "work"), "--json", str(out), "--baseline", "hf",
                           "--baseline-first", "--roofline"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["steps"] == 2 and record["measured_steps"] == 1 and record["baseline_first"] is True
    lo, hi = record["s_per_step_range"]
    assert lo <= record["s_per_step"] <= hi
    # Each timed phase against the machine's measured limits: a lower bound, so a fraction in (0, 1].
    phases = record["roofline"]["phases"]
    assert {"gen", "update_actor"} <= set(phases), phases
    assert all(0 < p["fraction"] <= 1 for p in phases.values()), phases
    assert {"gen", "update_weights", "update_actor", "reward", "adv"} <= set(record["phases"])
    # One epoch over one mini-batch: the old log-probs come from the update's own forward (no pass of their own).
    assert "old_log_prob" not in record["phases"]
    # The phases are disjoint intervals inside the step (one measured step, so no median effects): their sum
    # cannot exceed it. How much is left outside them depends on the machine's load, so it is reported, not bounded.
    assert -1e-6 <= record["unaccounted_s"] < record["s_per_step"], record
    assert record["tokens_per_s"] > 0 and 0 < record["peak_rss_gb"] < 8
    # The single-process transformers baseline ran the same workload in the same command, timed alike.
    baseline = record["baseline"]
    assert baseline["name"] == "hf" and baseline["steps"] == 2 and baseline["measured_steps"] == 1
    assert {"gen", "reward", "update_actor"} == set(baseline["phases"])
    assert -1e-6 <= baseline["unaccounted_s"] < baseline["s_per_step"], baseline
    assert baseline["tokens_per_s"] > 0 and 0 < baseline["peak_rss_gb"] < 8
    assert record["speedup"] == pytest.approx(baseline["s_per_step"] / record["s_per_step"])


def test_bench_dispatch_reports_both_paths_with_the_data_planes_bytes_within_its_shard(tmp_path):
    """`verl bench dispatch` (issue 29) at 2 ranks: a record per path; the data plane's bytes received stay within
    1.2x of what the rank's workers consumed, and the legacy path moved its batches as objects."""
    out = tmp_path / "dispatch.json"
    proc = subprocess.run([sys.executable, "-m", "verl.cli", "bench", "dispatch", "--nproc", "2", "--steps", "2",
                           "--rows-per-rank", "8", "--workdir", str(tmp_path / "work"), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = {r["path"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"data_plane", "legacy"}
    ours, legacy = records["data_plane"], records["legacy"]
    assert ours["nproc"] == legacy["nproc"] == 2 and ours["rows"] == legacy["rows"] == 16
    assert ours["shard_bytes_per_rank"] == legacy["shard_bytes_per_rank"] > 0  # the same work consumed
    assert ours["received_over_shard"] <= 1.2, ours
    assert legacy["object_collective_bytes"] == legacy["bytes_received_per_rank"] > 0
    assert ours["object_collective_bytes"] < ours["bytes_received_per_rank"]
    assert "legacy_over_data_plane" in proc.stdout
    # The two runs are GRPO with actor TP 2 and rollout TP 1 (rows move between the replicas): the same
    # training on both paths (see helpers.train_runs.assert_same_run_on_both_paths).
    sharded, legacy_run = (read_metrics(tmp_path / "work" / f"{path}_n2") for path in ("data_plane", "legacy"))
    assert sorted(sharded) == [1, 2]
    assert_same_run_on_both_paths(legacy_run, sharded)
