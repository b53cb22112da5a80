"""The prepared GPU command (issue 41) rehearsed on CPU, so a lease does not first fail on a typo:

- ``bash tests/run_gpu.sh fast --dry-run`` runs every stage's commands with CPU stand-ins (the benches on tiny models
  with --device cpu, the trainers' configs and overrides checked as verl train checks them) and writes each stage's
  JSON, the summary and the log archive: no more files in $OUT than the device tool brings back;
- ``--only`` and the time budget pick the stages; a stage name it does not know is one line, exit 2;
- ``verl bench reshard/rollout/kernels --device cuda`` refuse in one line (exit 2) where torch sees no GPU;
- what a lease carries (the working tree + the wheels of launch/fetch_gpu_wheels.sh) stays under 64 MiB;
- the stage records read the GPU run's outputs (verl train's metrics.jsonl, pytest's junit XML, bench JSONs).
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))
from helpers import gpu_fast  # noqa: E402

CARRY_LIMIT = 64 * 2**20          # the device tool's working tree + carried paths
OUT_FILES_LIMIT = 8               # files it brings back from $OUT
OUT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _run_fast(tmp_path, *args, timeout=240):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    return subprocess.run(["bash", os.path.join(REPO, "tests", "run_gpu.sh"), "fast", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_runs_every_stage_and_writes_what_the_device_tool_brings_back(tmp_path):
    proc = _run_fast(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    files = sorted(os.listdir(out))
    assert len(files) <= OUT_FILES_LIMIT and all(OUT_NAME.match(f) for f in files), files
    assert set(files) == {f"{s}.json" for s in gpu_fast.STAGES} | {"summary.json", "logs.tar.gz"}
    summary = json.loads((out / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == list(gpu_fast.STAGES)
    assert summary["not_passed"] == [], {s["stage"]: s for s in summary["stages"] if s["status"] != "pass"}
    stages = {s["stage"]: s for s in summary["stages"]}
    assert all(s["dry_run"] and s["wall_s"] >= 0 for s in stages.values())
    # The trainers' configs with every override, as the GPU run will start them.
    assert stages["qwen05b"]["figures"]["total_training_steps"] == 5
    assert stages["quickstart"]["figures"]["rl_steps"] == 30
    pool = stages["pool"]["figures"]
    assert pool["standalone_pool"]["ranks"] == 2 and pool["separate_async"]["mode"] == "separate_async"
    # The benches ran for real on the CPU stand-ins, through the same figures code the GPU run uses.
    bench = stages["bench"]["figures"]
    assert bench["kernels"]["device"] == "cpu" and bench["kernels"]["min_ratio_1mb"] > 0
    assert bench["reshard"]["verified"] and bench["reshard"]["device"] == "cpu"
    assert bench["rollout"]["native_tokens_per_s"] > 0 and bench["rollout"]["hf_tokens_per_s"] > 0
    assert {"bench.copy_1mb", "bench.reshard_over_copy", "bench.rollout_over_hf"} <= set(summary["targets"])
    assert "stage" in proc.stdout and "total" in proc.stdout  # the table


def test_only_and_the_budget_pick_the_stages_and_unknown_names_refuse(tmp_path):
    bad = _run_fast(tmp_path, "--dry-run", "--only", "bench,nosuch", timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "nosuch" in bad.stderr, bad.stderr
    # A zero budget runs nothing: every selected stage (setup first, always) is recorded as skipped.
    proc = _run_fast(tmp_path, "--dry-run", "--only", "bench,qwen05b", "--budget-s", "0", timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(s["stage"], s["status"]) for s in summary["stages"]] == [
        ("setup", "skipped"), ("qwen05b", "skipped"), ("bench", "skipped")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
@pytest.mark.parametrize("module,args", [
    ("verl.bench.reshard", ["--model", "configs/models/qwen2_0p7m_arith.json", "--train", "tp=1", "--rollout", "tp=1",
                            "--nproc", "1"]),
    ("verl.bench.rollout", ["--model", "configs/models/qwen2_tiny_arith.json"]),
    ("verl.bench.kernels", []),
])
def test_device_cuda_refuses_in_one_line_without_a_gpu(module, args, capsys):
    import importlib

    assert importlib.import_module(module).main([*args, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--device cuda: expected a CUDA device, found none" in err, err


def _wheel_list() -> list[tuple[str, int]]:
    text = subprocess.run(["bash", os.path.join(REPO, "launch", "fetch_gpu_wheels.sh"), "--list"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout
    return [(spec, int(size)) for spec, size in (line.split() for line in text.splitlines())]


def test_what_a_lease_carries_stays_under_64_mib():
    """The working tree that travels (tracked + untracked-not-ignored files) plus .whl/: the wheels' real sizes
    when fetched (then one per listed package, each near its listed size), else the listed sizes."""
    listed = _wheel_list()
    names = {spec.split("==")[0].replace("-", "_") for spec, _ in listed}
    assert {"megatron_core", "omegaconf", "hydra_core", "antlr4_python3_runtime", "tensordict"} <= names
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    tree = sum(os.path.getsize(os.path.join(REPO, f)) for f in files if f and os.path.isfile(os.path.join(REPO, f)))
    wheel_dir = os.path.join(REPO, ".whl")
    wheels = sorted(f for f in os.listdir(wheel_dir) if f.endswith(".whl")) if os.path.isdir(wheel_dir) else []
    if wheels:
        sizes = {w.split("-")[0].lower(): os.path.getsize(os.path.join(wheel_dir, w)) for w in wheels}
        assert set(sizes) == names, f"expected one wheel per listed package {sorted(names)}, found {wheels}"
        for spec, size in listed:
            got = sizes[spec.split("==")[0].replace("-", "_")]
            assert 0.5 * size <= got <= 2 * size, (spec, size, got)
        carried = sum(sizes.values())
    else:
        carried = sum(size for _, size in listed)
    assert tree + carried < CARRY_LIMIT, f"tree {tree / 2**20:.1f} MiB + wheels {carried / 2**20:.1f} MiB"


def test_records_read_the_gpu_runs_outputs(tmp_path):
    """The non-dry figures code on files shaped like the GPU run's (metrics.jsonl lines as verl train writes them,
    pytest's junit XML, a bench reshard JSON): the numbers below are computed by hand from these inputs."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "qwen05b").mkdir(parents=True)
    steps = [{"step": i, "timing_s/step": s, "timing_s/gen": g, "timing_s/update_actor": s - g,
              "timing_per_token_ms/update_actor": 0.02, "perf/total_num_tokens": 73728,
              "perf/max_memory_allocated_gb": m, "perf/mfu/actor": 0.3}
             for i, (s, g, m) in enumerate([(9.0, 5.0, 20.0), (3.0, 1.0, 30.0), (4.0, 2.0, 25.0), (5.0, 3.0, 26.0)],
                                           start=1)]
    (work / "qwen05b" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    rec = gpu_fast.record("qwen05b", 0, 30.0, 120, str(work), str(out), dry_run=False)
    f = rec["figures"]
    assert f["s_per_step"] == 4.0 and f["first_step_s"] == 9.0  # median after step 1
    assert f["peak_memory_allocated_gb"] == 30.0 and f["update_actor_tokens_per_s"] == pytest.approx(50000.0)
    assert f["phases"]["gen"] == 2.0 and rec["targets"]["s_per_step"]["met"] is False  # 4.0 > 3.6
    # The command exited 0, but the step missed its target: the stage fails, naming it.
    assert rec["status"] == "fail" and rec["missed_targets"] == ["s_per_step"] and rec["targets_enforced"]
    assert json.loads((out / "qwen05b.json").read_text())["status"] == "fail"
    (work / "tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.a" name="t1" time="1.5"/>'
        '<testcase classname="tests.gpu.a" name="t2" time="0.5"><failure message="x"/></testcase>'
        '<testcase classname="tests.kernels.b" name="t3" time="0.1"><skipped message="y"/></testcase>'
        '</testsuite></testsuites>')
    rec = gpu_fast.record("tests", 1, 10.0, 120, str(work), str(out), dry_run=False)
    assert rec["status"] == "fail" and (rec["figures"]["passed"], rec["figures"]["failed"]) == (1, 1)
    assert rec["figures"]["failed_tests"] == ["tests.gpu.a::t2"]
    # bench: the reshard JSON alone -> the stage says which benches left nothing, and does not pass.
    (work / "bench_reshard.json").write_text(json.dumps({"verified": True, "seconds_over_memcpy": 1.5}))
    rec = gpu_fast.record("bench", 0, 50.0, 100, str(work), str(out), dry_run=False)
    assert rec["status"] == "fail" and rec["figures"]["missing"] == ["kernels", "rollout"]
    assert rec["targets"]["reshard_over_copy"]["met"] is True
    assert gpu_fast.record("pool", 124, 90.0, 90, str(work), str(out), dry_run=False)["status"] == "timeout"


@pytest.mark.parametrize("gain, status, missed", [(12.5, "pass", []), (0.0, "fail", ["learns"]),
                                                   (None, "fail", ["learns"])])
def test_a_stage_passes_only_when_its_targets_are_met(tmp_path, gain, status, missed):
    """The quickstart stage's one target (RL gains over the SFT start): met passes; missed, or not measured (no
    RL validation at the end), fails; the CPU rehearsal (dry run) reports the same figures against the same bounds
    without enforcing them. Every bound comes from gpu_fast.TARGETS."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "quickstart").mkdir(parents=True)
    (work / "quickstart" / "summary.json").write_text(json.dumps({"val_accuracy_gain_points": gain}))
    rec = gpu_fast.record("quickstart", 0, 60.0, 300, str(work), str(out), dry_run=False)
    assert (rec["status"], rec["missed_targets"]) == (status, missed)
    assert rec["targets"]["learns"] == {"value": gain, "above": gpu_fast.TARGETS["quickstart"]["learns"][1],
                                        "met": None if gain is None else gain > 0}
    # Bench figures far below every bound (CPU stand-ins): reported, not enforced, in the dry run only.
    (work / "bench_kernels.json").write_text(json.dumps([
        {"bytes": 2**20, "ratio_vs_memcpy": 0.1, "case": "a", "device": "cpu", "dtype": "float32"},
        {"bytes": 2**24, "ratio_vs_memcpy": 0.2, "case": "b", "device": "cpu", "dtype": "float32"}]))
    (work / "bench_reshard.json").write_text(json.dumps({"verified": True, "seconds_over_memcpy": 9.0}))
    (work / "bench_rollout.json").write_text(json.dumps({"batch": 2, "new_tokens": 4, "native": {"tokens_per_s": 1.0},
                                                         "native_over_hf": 0.5}))
    dry = gpu_fast.record("bench", 0, 5.0, 100, str(work), str(out), dry_run=True)
    assert dry["status"] == "pass" and not dry["targets_enforced"] and "missed_targets" not in dry
    assert all(t["met"] is False for t in dry["targets"].values()) and len(dry["targets"]) == 4
    real = gpu_fast.record("bench", 0, 5.0, 100, str(work), str(out), dry_run=False)
    assert real["status"] == "fail" and real["missed_targets"] == sorted(gpu_fast.TARGETS["bench"])
