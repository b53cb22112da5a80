"""SGLang as the trainer's rollout (`actor_rollout_ref.rollout.name=sglang`): GRPO on the arithmetic task,
2 CPU ranks, Megatron TP2 actor, SGLang engines fed by per-rank pushes of resharded weights.

- rollout TP1 (two engines, one per rank): over 12 steps from an SFT warm start, after every push SGLang's
  greedy answers to a few prompts are Megatron's argmax token by token (trainer_parity_driver.py), the
  rollout's log-probs match the actor's (``training/rollout_probs_diff_max`` <= 1e-3 every step) and the
  held-out accuracy rises;
- rollout TP2 (one engine, two SGLang ranks, each fed by its own trainer rank): a run preempted by
  SIGUSR1 checkpoints and exits 0, the same command resumes it, and SIGKILL of the engine's owner rank
  ends the job;
- a standalone rollout pool (`rollout.nnodes=1`) serving SGLang gets the actor's weights every step;
- no SGLang process outlives a finished, preempted or killed run (the process table is checked), and no
  rank's shared weight buffer outlives a finished or preempted one in /dev/shm.
"""

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(ROOT, "tests", "sglang", "trainer_parity_driver.py")
CONFIG = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
SFT_CONFIG = os.path.join(ROOT, "configs", "sft_arith_tiny.yaml")
RUN_TIMEOUT_S = 420


def sglang_processes() -> set[int]:
    """Pids of SGLang's engine processes (their titles start with ``sglang::``)."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(part.startswith("sglang::") for part in proc.info["cmdline"] or []):
                found.add(proc.pid)
        except psutil.Error:
            continue
    return found


def assert_no_sglang_left(before: set[int]) -> None:
    deadline = time.time() + 10  # a killed engine's children get SIGKILL from the kernel: give them a moment
    while (left := sglang_processes() - before) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, f"SGLang processes survived the run: {[psutil.Process(p).cmdline() for p in left]}"


def torch_shm_files() -> set[str]:
    """/dev/shm names of tensors shared by file name (torch's ``file_system`` strategy: ``torch_<pid>_...``)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("torch_")}


def assert_no_shared_buffer_left(before: set[str]) -> None:
    left = torch_shm_files() - before
    assert not left, f"weight buffers left in /dev/shm: {sorted(left)}"


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    from verl.utils.dataset import arithmetic

    out = str(tmp_path_factory.mktemp("arith"))
    arithmetic.main(["--out", out])  # the quickstart's data (4000 train, 256 held-out problems)
    return out


@pytest.fixture(scope="module")
def sft_model(arith, tmp_path_factory):
    """A warm start the RL stage can improve on: the quickstart's SFT recipe, 400 of its 1000 steps with its
    30 warm-up steps (greedy held-out accuracy ~0.50, as after the full recipe)."""
    from verl.trainer import main_sft

    out = tmp_path_factory.mktemp("sft")
    assert main_sft.main(["--config", SFT_CONFIG, f"data.train_files={arith}/train.parquet",
                          f"data.val_files={arith}/test.parquet", f"model.tokenizer_path={arith}/tokenizer",
                          f"trainer.output_dir={out}", "trainer.total_training_steps=400",
                          "optim.warmup_steps_ratio=0.075", "trainer.logger=[]", "trainer.test_freq=-1"]) == 0
    return str(out / "hf")


def train_args(arith, model, out, *extra):
    return ["--config", CONFIG, f"data.train_files={arith}/train.parquet", f"data.val_files={arith}/test.parquet",
            f"data.tokenizer={arith}/tokenizer", f"actor_rollout_ref.model.path={model}", f"trainer.output_dir={out}",
            "actor_rollout_ref.rollout.name=sglang", "trainer.logger=[console]", *extra]


def start(sglang_python, args, parity_out, out_dir):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", VERL_PARITY_OUT=str(parity_out), PYTHONWARNINGS="ignore")
    log = open(out_dir / "run.log", "ab")
    return subprocess.Popen([sglang_python, "-m", "verl.launcher.spawn", "--nproc", "2", "--",
                             sglang_python, DRIVER, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait(proc, out_dir, timeout_s=RUN_TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"run did not finish in {timeout_s} s:\n{(out_dir / 'run.log').read_text()[-4000:]}")


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")] if os.path.exists(path) else []


def wait_for_step(out_dir, step: int, proc, timeout_s=RUN_TIMEOUT_S) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(r.get("step") == step and "timing_s/step" in r for r in read_lines(out_dir / "metrics.jsonl")):
            return
        if proc.poll() is not None:
            log = (out_dir / "run.log").read_text()[-4000:]
            pytest.fail(f"run exited {proc.returncode} before step {step}:\n{log}")
        time.sleep(0.5)
    pytest.fail(f"no step {step} within {timeout_s} s")


def check_parity(parity_out, pushes: int, exact: bool = True) -> None:
    records = read_lines(parity_out)
    assert len(records) == pushes if exact else len(records) >= pushes, records
    for r in records:
        assert r["tokens"] > 0 and r["mismatches"] == 0, r  # SGLang's greedy is Megatron's argmax
        assert r["max_logprob_diff"] <= 1e-4, r


def test_grpo_with_sglang_rollout_tp1_learns_with_parity_after_every_push(sglang_python, arith, sft_model, tmp_path):
    before = sglang_processes()
    shm_before = torch_shm_files()
    steps = 12
    proc = start(sglang_python, train_args(
        arith, sft_model, tmp_path, f"trainer.total_training_steps={steps}", "trainer.test_freq=12",
        "trainer.save_freq=-1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1"), tmp_path / "parity.jsonl", tmp_path)
    assert wait(proc, tmp_path) == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert_no_sglang_left(before)
    assert_no_shared_buffer_left(shm_before)
    assert "Traceback" not in (tmp_path / "run.log").read_text()  # a clean exit, SGLang's shutdown included

    check_parity(tmp_path / "parity.jsonl", steps)
    records = read_lines(tmp_path / "metrics.jsonl")
    train = [r for r in records if "timing_s/step" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert r["training/rollout_probs_diff_max"] <= 1e-3, r["training/rollout_probs_diff_max"]
        assert r["timing_s/push_weights"] > 0 and r["timing_s/reshard"] > 0
        assert 0 < r["perf/push_handle_bytes"] < 4096  # handles, not weights
    val = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    assert len(val) == 2, val
    # It learns: the RL objective itself, the sampled batch's score (64 prompts x 8 = 512 samples a step), rises from
    # the first 4 steps to the last 4 by more than twice the standard error of that difference (~0.013 at a score
    # near 0.2, more with the samples of a group correlated). The greedy held-out accuracy at the two ends (256
    # problems) moves too little in 12 steps to gate on: fp32-level changes in the actor's attention kernel moved
    # its gain from +5 to +0.8 points while the score still rose by 0.05.
    scores = [r["critic/score/mean"] for r in train]
    assert sum(scores[-4:]) / 4 >= sum(scores[:4]) / 4 + 0.03, scores


def test_sglang_rollout_tp2_preempted_run_resumes_and_a_killed_owner_ends_the_job(sglang_python, arith, sft_model,
                                                                                   tmp_path):
    before = sglang_processes()
    shm_before = torch_shm_files()
    args = train_args(arith, sft_model, tmp_path, "trainer.total_training_steps=6", "trainer.test_freq=-1",
                      "trainer.save_freq=-1", "trainer.val_before_train=false", "data.train_batch_size=16",
                      "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
                      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
                      "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                      "trainer.resume_mode=auto")
    proc = start(sglang_python, args, tmp_path / "parity.jsonl", tmp_path)
    wait_for_step(tmp_path, 2, proc)
    proc.send_signal(signal.SIGUSR1)  # the launcher forwards it: finish the step, checkpoint, exit 0
    assert wait(proc, tmp_path) == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert_no_sglang_left(before)
    assert_no_shared_buffer_left(shm_before)  # each rank's buffer, mapped by its SGLang rank until the shutdown
    done = max(r["step"] for r in read_lines(tmp_path / "metrics.jsonl"))
    assert done >= 2 and os.path.isdir(tmp_path / "checkpoints" / f"global_step_{done}")

    proc = start(sglang_python, args, tmp_path / "parity.jsonl", tmp_path)
    wait_for_step(tmp_path, done + 1, proc)  # resumed: the step after the checkpoint
    ranks = psutil.Process(proc.pid).children()
    owner = next(p for p in ranks if p.environ().get("RANK") == "0")
    owner.send_signal(signal.SIGKILL)
    assert wait(proc, tmp_path) != 0
    assert_no_sglang_left(before)
    check_parity(tmp_path / "parity.jsonl", done + 1, exact=False)  # every push of both runs


def test_bench_reshard_times_the_push_against_the_in_place_reshard(sglang_python, tmp_path):
    """`verl bench reshard --push sglang`: the trainer's weight sync (reshard into shared buffers + push) beside
    the in-place reshard of the same plan and one SGLang weight-update call, in the same run."""
    out = tmp_path / "push.json"
    before = sglang_processes()
    shm_before = torch_shm_files()
    proc = subprocess.run([os.path.join(os.path.dirname(sglang_python), "verl"), "bench", "reshard", "--model",
                           os.path.join(ROOT, "configs", "models", "qwen2_tiny_arith.json"), "--train", "tp=2",
                           "--rollout", "tp=1", "--nproc", "2", "--push", "sglang", "--repeats", "2",
                           "--dtype", "float32", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["verified"] and result["naive_verified"]
    assert result["push_buckets"] == 1 and result["push_seconds"] > result["seconds"] > 0
    assert result["sglang_call_seconds"] > 0
    assert result["push_budget_seconds"] == pytest.approx(2 * result["seconds"] + result["sglang_call_seconds"])
    assert_no_sglang_left(before)
    assert_no_shared_buffer_left(shm_before)


def test_sglang_in_a_standalone_rollout_pool_gets_the_actors_weights_every_step(sglang_python, arith, sft_model,
                                                                               tmp_path):
    """2 training ranks + a rollout pool of 1 rank serving one SGLang engine (docs/rollout_pool.md): the pool rank
    receives its shard into the buffer it pushes by handle (delta syncs, verified buckets); the rollout's
    log-probs are the actor's at every step; the engine and its shared buffer are gone after the run."""
    before = sglang_processes()
    shm_before = torch_shm_files()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sglang_python, "-m", "verl.cli", "train", *train_args(
            arith, sft_model, tmp_path, "trainer.total_training_steps=3", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.val_before_train=false", "trainer.logger=[console,csv]",
            "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.delta=true")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_no_sglang_left(before)
    assert_no_shared_buffer_left(shm_before)
    train = [r for r in read_lines(tmp_path / "metrics.jsonl") if "timing_s/step" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["training/rollout_probs_diff_max"] <= 1e-3, r["training/rollout_probs_diff_max"]
        assert r["perf/weight_sync_bytes"] > 0


def test_sglang_rollout_in_colocate_async_trains_off_policy_and_cleans_up(sglang_python, arith, sft_model, tmp_path):
    """verl's V1 colocate_async with SGLang generating (TP1: an engine per rank): segments of partial rollout on
    SGLang (per-row limits, the stop rule between rounds), a warm-up batch so that trained groups are a version
    old, verl's off-policy metrics every step; no engine or shared buffer outlives the run."""
    before = sglang_processes()
    shm_before = torch_shm_files()
    proc = start(sglang_python, train_args(
        arith, sft_model, tmp_path, "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.val_before_train=false", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.use_v1=true",
        "trainer.v1.trainer_mode=colocate_async", "algorithm.rollout_correction.rollout_is=token"),
        tmp_path / "parity.jsonl", tmp_path)
    assert wait(proc, tmp_path) == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert_no_sglang_left(before)
    assert_no_shared_buffer_left(shm_before)
    train = [r for r in read_lines(tmp_path / "metrics.jsonl") if "timing_s/step" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        for key in ("training/off_policy/trajectory_staleness_worst/max", "training/off_policy/trajectory_spans/max",
                    "rollout_corr/rollout_is_mean", "timing_s/gen"):
            assert key in r, (r["step"], key)
    # The warm-up batch was generated on version 0 and trained at step 2 or later: a version old at least.
    assert max(r["training/off_policy/trajectory_staleness_worst/max"] for r in train[1:]) >= 1
