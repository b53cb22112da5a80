"""verl's V1 asynchronous trainers end to end (`verl train`, 2 training ranks; separate_async with a rollout pool
rank of its own): partial rollout across weight syncs, verl's off-policy metrics, the rollout correction in the
loss, and prompt accounting across a SIGKILL and a preemption (SIGUSR1): every prompt of an epoch is trained at
most once, and the ones the run drew are trained, evicted or still in the buffer -- none lost.

Small batches (16 prompts x 4 responses, 64 training prompts: four steps an epoch) so that a run crosses epochs
and the buffer holds groups of several ages; sizes chosen so the micro-batches divide (actor TP 2: DP 1)."""

import signal
import subprocess
import time

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.train_runs import (  # noqa: E402
    REPO,
    RUN_TIMEOUT_S,
    check_accounting,
    kill_tree,
    ledger,
    read_metrics,
    run_train,
    run_until_step_then_kill,
    train_cmd,
    train_env,
)

from verl.utils.timeline import TRAINER_LANE, pool_lane, read_timeline  # noqa: E402

pytestmark = pytest.mark.distributed

SMALL = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "trainer.save_freq=1",
         "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.export_hf_at_end=false",
         "actor_rollout_ref.nccl_timeout=60"]
OFF_POLICY_KEYS = [f"training/off_policy/{name}/{stat}" for name in
                   ("trajectory_spans", "trajectory_staleness", "trajectory_staleness_worst")
                   for stat in ("mean", "max", "min")] + ["training/off_policy/evicted_samples"]


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith"))


def test_colocate_async_learns_offpolicy_and_resumes_after_sigkill_without_losing_a_prompt(tmp_path,
                                                                                          arithmetic_data):
    out = tmp_path / "colocate"
    cmd = train_cmd("grpo_arith_tiny.yaml", out, arithmetic_data, *SMALL, "trainer.total_training_steps=7",
                    "trainer.v1.trainer_mode=colocate_async", "algorithm.rollout_correction.rollout_is=token",
                    "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                    "algorithm.rollout_correction.rollout_rs_threshold=4.0")
    run_until_step_then_kill(cmd, out, 3)
    before = ledger(out)
    with open(out / "prompt_ledger.jsonl", "a", encoding="utf-8") as fh:  # a line the kill cut short
        fh.write('{"step": 4, "trained": ["0-1", "0-')
    run_train(cmd)
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, 8))
    for step in range(1, 8):
        record = metrics[step]
        wanted = OFF_POLICY_KEYS + ["timing_s/gen", "timing_s/update_weights", "rollout_corr/kl",
                                    "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"]
        missing = [k for k in wanted if k not in record]
        assert not missing, f"step {step} lacks {missing}"
    # Warm-up batch + partial rollout: after step 1, trained trajectories were started on older weights, and
    # some were interrupted by a weight sync and finished on the next version (spans > 1).
    assert max(metrics[s]["training/off_policy/trajectory_staleness_worst/max"] for s in range(2, 8)) >= 1
    assert max(metrics[s]["training/off_policy/trajectory_spans/max"] for s in range(2, 8)) >= 2
    lines = ledger(out)
    assert len(before) >= 3 and lines[:3] == before[:3]  # the killed run's checkpointed steps are kept as they were
    trained = check_accounting(lines, 7)
    # 7 steps x 16 = 112 prompts: all 64 of epoch 0 and 48 of epoch 1.
    epoch0 = {uid for uid in trained if uid.startswith("0-")}
    assert len(epoch0) == 64
    assert any(line["reissued"] for line in lines[3:]), "the resumed run reissued no in-flight prompt"


def test_separate_async_pool_streams_and_preempts_with_a_checkpoint(tmp_path, arithmetic_data):
    """2 training ranks + 1 rollout pool rank; two mini-batch updates per weight sync (16 = 2 x 8). SIGUSR1 after
    step 2: the step finishes, checkpoints, the pool stops, exit 0; the rerun resumes and counts every prompt."""
    out = tmp_path / "separate"
    cmd = train_cmd("grpo_arith_tiny.yaml", out, arithmetic_data, *SMALL, "trainer.total_training_steps=5",
                    "trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
                    "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                    "trainer.v1.sampler.max_off_policy_strategy=wait", "trainer.v1.sampler.max_off_policy_threshold=2")
    # Each pool segment takes 0.3 s longer (fault injection): at this size a segment is ~10 ms, as short as the
    # trainer's phases, so whether one happened to overlap them was left to the scheduler.
    env = {**train_env(), "VERL_TEST_SLOW_POOL_GENERATION": "0:0.3"}
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and launcher.poll() is None:
            if (out / "metrics.jsonl").is_file() and 2 in read_metrics(out):
                break
            time.sleep(0.05)
        assert launcher.poll() is None, "the run ended before step 2"
        launcher.send_signal(signal.SIGUSR1)
        output, _ = launcher.communicate(timeout=120)
    finally:
        kill_tree(launcher.pid)
    assert launcher.returncode == 0, output[-3000:]
    assert "preempted" in output
    stopped = max(read_metrics(out))
    assert 2 <= stopped < 5 and (out / "checkpoints" / f"global_step_{stopped}").is_dir()
    run_train(cmd, env={"VERL_TEST_SLOW_POOL_GENERATION": "0:0.3"})
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, 6))
    for step in range(1, 6):
        record = metrics[step]
        missing = [k for k in OFF_POLICY_KEYS + ["timing_s/gen", "timing_s/update_weights", "actor/pg_loss",
                                                 "perf/weight_sync_bytes"] if k not in record]
        assert not missing, f"step {step} lacks {missing}"
        # wait: a group is never trained at an age above the threshold (G - P + 1 <= 2 versions)
        assert record["training/off_policy/trajectory_staleness_worst/max"] <= 1
        assert record["training/off_policy/evicted_samples"] == 0
    check_accounting(ledger(out), 5)
    # The run's timeline: the pool replica's segments and syncs in a lane of their own, and some of its
    # generation overlapping the trainer's work (its phases other than the wait for groups: what the
    # asynchronous mode is for).
    timeline = read_timeline(out)
    assert sorted(timeline) == list(range(1, 6))
    spans = [span for step in timeline.values() for span in step]
    generate = [(a, b) for lane, phase, a, b in spans if lane == pool_lane(0) and phase == "generate"]
    training = [(a, b) for lane, phase, a, b in spans if lane == TRAINER_LANE and phase not in ("gen", "testing")]
    pool_syncs = [phase for lane, phase, _, _ in spans if lane == pool_lane(0) and phase == "update_weights"]
    assert generate and training and pool_syncs
    assert any(min(b1, b2) - max(a1, a2) > 0 for a1, b1 in generate for a2, b2 in training), \
        "no pool segment overlapped the trainer's work"


def test_separate_async_native_pool_at_tp2_agrees_on_every_command(tmp_path, arithmetic_data):
    """A native rollout replica of TP 2 in the pool: each pool rank takes the controller's commands on its own
    thread, so without agreement one rank could start a segment while the other handles a sync (mismatched
    collectives, a hang until the timeout, or tokens from TP shards of two weight versions). Pool rank 1's command
    thread is delayed 0.3 s (fault injection) so its commands always arrive late; the run must finish, and the
    first step's weight-sync check (rollout log-probs = the actor's on the same tokens) must hold."""
    out = tmp_path / "pool_tp2"
    cmd = train_cmd("grpo_arith_tiny.yaml", out, arithmetic_data, *SMALL, "trainer.total_training_steps=3",
                    "trainer.save_freq=-1", "trainer.v1.trainer_mode=separate_async",
                    "trainer.v1.separate_async.parameter_sync_step=2", "actor_rollout_ref.rollout.nnodes=1",
                    "actor_rollout_ref.rollout.n_gpus_per_node=2",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    env = {**train_env(), "VERL_TEST_POOL_COMMAND_DELAY": "1:0.3"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2, 3]
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-3, metrics[1]
