"""Waiting for the slowest rollout is bounded by actor_rollout_ref.rollout.generation_timeout, not by the
collective timeout (actor_rollout_ref.nccl_timeout) that bounds every other wait (issue 44.2).

A slow rollout is injected with VERL_TEST_SLOW_GENERATION=RANK:SECONDS (the rank's generation call takes that much
longer). With the collective timeout at 15 s, a rank 25 s late used to end the job in the next collective after
15 s with gloo's timeout; now the ranks wait for it up to the rollout's deadline, and past the deadline rank 0 says
which ranks and rollout replicas had not finished."""

import subprocess
import time

import pytest

from verl.launcher.spawn import run_ranks_with_rank

pytestmark = pytest.mark.distributed


def _meet(rank, world, timeout_s, tp):
    from verl.single_controller.generation_wait import GenerationTimeoutError, GenerationWait

    wait = GenerationWait(timeout_s, tp)
    t0 = time.monotonic()
    try:
        wait.wait("actor_rollout_ref.generate_sequences")
    except GenerationTimeoutError as err:
        return {"error": str(err), "waited": time.monotonic() - t0}
    return {"error": "", "waited": time.monotonic() - t0}


def test_a_rollout_past_the_deadline_is_named_and_one_within_it_is_waited_for(monkeypatch):
    monkeypatch.setenv("VERL_TEST_SLOW_GENERATION", "1:4")  # rank 1 (replica 1 at rollout TP 1) 4 s late
    on_time = run_ranks_with_rank(_meet, 2, 30.0, 1, timeout_s=120)
    # (How long rank 0 waited depends on when each rank started; that it waited without an error is the point.)
    assert all(not r["error"] for r in on_time), on_time
    late = run_ranks_with_rank(_meet, 2, 1.5, 1, timeout_s=120)
    first = late[0]["error"]
    assert first.startswith("actor_rollout_ref.generate_sequences: rank(s) [1] (rollout replica(s) [1]) had not "
                            "finished after actor_rollout_ref.rollout.generation_timeout=1.5 s"), late
    assert late[0]["waited"] < 4, late  # rank 0 gave up at the deadline, not when the slow rank arrived


def _meet_or_leave(rank, world, timeout_s):
    """Rank 1 closes its connections instead of meeting (what its death does to rank 0's side), then waits
    for rank 0 to have seen it; rank 0 returns what it raised."""
    import torch.distributed as dist

    from verl.single_controller.generation_wait import GenerationWait, RankLostError

    wait = GenerationWait(timeout_s, 1)
    if rank == 1:
        dist.destroy_process_group(wait.group)
        dist.destroy_process_group()
        time.sleep(5)
        return ""
    t0 = time.monotonic()
    try:
        wait.wait("actor_rollout_ref.generate_sequences")
    except RankLostError as err:
        return str(err)
    return f"no RankLostError after {time.monotonic() - t0:.1f} s"


def test_a_rank_that_went_away_is_named_as_lost_not_as_late():
    """A dead rank's connections close: gloo words that as a failed monitored barrier too, long before the
    deadline. The line says which rank was lost (slurm/lib/step.sh maps it to its node), not "had not finished
    after 600 s", which would send the user to raise a timeout that never ran out (CI run of stop 62)."""
    text = run_ranks_with_rank(_meet_or_leave, 2, 600.0, timeout_s=120)[0]
    assert text.startswith("actor_rollout_ref.generate_sequences: lost rank(s) [1] (rollout replica(s) [1]): "
                           "their connection closed after "), text
    assert "before the 600 s generation deadline" in text, text


def _one_step_cmd(tmp_path, name, generation_timeout_s, *extra):
    """(output dir, `verl train` command): one tiny GRPO step, collective timeout 15 s, no validation or saves."""
    from helpers.tiny_models import arithmetic_data_args
    from helpers.train_runs import train_cmd

    out = tmp_path / name
    return out, train_cmd("grpo_arith_tiny.yaml", out, arithmetic_data_args(tmp_path / "arith"),
                          "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.val_before_train=false",
                          "trainer.test_freq=-1", "trainer.export_hf_at_end=false",
                          "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                          "actor_rollout_ref.nccl_timeout=15",
                          f"actor_rollout_ref.rollout.generation_timeout={generation_timeout_s}", *extra)


def test_verl_train_waits_for_a_rollout_longer_than_the_collective_timeout(tmp_path):
    """The wiring: `verl train` (2 ranks, colocated GRPO) with the collective timeout at 15 s and rank 1's rollout
    20 s late finishes its step (the collective after the rollout would have timed out before)."""
    from helpers.train_runs import read_metrics, run_train

    out, cmd = _one_step_cmd(tmp_path, "slow", 120)
    run_train(cmd, env={"VERL_TEST_SLOW_GENERATION": "1:20"})
    record = read_metrics(out)[1]
    assert record["timing_s/gen"] >= 20, record["timing_s/gen"]


def _pool_train(tmp_path, name, generation_timeout_s, slow_s, check=True):
    """The one step with 1 training rank + a 1-rank standalone rollout pool, the pool rank's rollout ``slow_s``
    late (VERL_TEST_SLOW_POOL_GENERATION)."""
    from helpers.train_runs import REPO, run_train, train_env

    out, cmd = _one_step_cmd(tmp_path, name, generation_timeout_s, "trainer.n_gpus_per_node=1",
                             "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=1")
    env = {"VERL_TEST_SLOW_POOL_GENERATION": f"0:{slow_s}"}
    if check:
        return out, run_train(cmd, env=env)
    return out, subprocess.run(cmd, cwd=REPO, env={**train_env(), **env}, capture_output=True, text=True, timeout=300)


def test_a_standalone_pool_is_waited_for_past_the_collective_timeout_and_named_past_its_deadline(tmp_path):
    """The pool's side of the wiring: training rank 0 waits for the pool's rollouts up to generation_timeout (20 s
    late under a 15 s collective timeout: the step finishes), and past it the job ends with one line naming the
    replica and its pool rank."""
    from helpers.train_runs import read_metrics

    out, _ = _pool_train(tmp_path, "waited", 120, 20)
    assert read_metrics(out)[1]["timing_s/gen"] >= 20
    t0 = time.monotonic()
    _, proc = _pool_train(tmp_path, "late", 4, 30, check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert ("rollout pool replica 0 (pool rank 1) had not returned its rollouts after "
            "actor_rollout_ref.rollout.generation_timeout=4 s") in text, text[-3000:]
    assert time.monotonic() - t0 < 120  # the deadline ended it, not the pool's 30 s sleep plus the collective timeouts
