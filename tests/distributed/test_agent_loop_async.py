"""`verl train` with ``rollout.multi_turn.enable`` under ``trainer.v1.trainer_mode=colocate_async`` (issue 46 item 4):
tool_agent trajectories that live across steps in the replay buffer, on 2 ranks (2 rollout replicas, each running
its own agent loops). Turns end on ~1 token in 8 (tests/helpers/forced_tool_calls.py, ``test_random_length_calls``).
A second run resumes from the checkpoint of step 3: the finished agent trajectories left in the replay buffer (how
many depends on the timing) come back from its shards with their masks and prompts, the in-flight groups are
reissued, and every prompt is trained once."""

import pytest
import torch
from helpers.agent_runs import async_agent_cmd
from helpers.train_runs import check_accounting, ledger, read_metrics, run_train

pytestmark = pytest.mark.distributed

STEPS = 3  # then two more after the resume


def test_colocate_async_trains_agent_trajectories_and_resumes_with_them(tmp_path):
    out, cmd = async_agent_cmd(
        tmp_path, "colocate_async", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.save_freq=3", "trainer.test_freq=-1", "trainer.resume_mode=auto")
    run_train(cmd + [f"trainer.total_training_steps={STEPS}"])
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, record in metrics.items():
        assert record["num_turns/max"] <= 6 and record["tool_call_counts/max"] <= 2, (step, record)
        assert record["tool_call_errors/max"] == 0
        assert record["response_length/max"] <= 64  # the trained (mask 1) tokens, within the budget
    # Step 1 trains trajectories sampled on version 0 only: the rollout's log-probs are the actor's on the
    # sampled tokens (the weight-sync check; the tool tokens masked out).
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-4
    # The phases: step 1's ran until a batch was ready (the warm-up batch's groups in flight too); a step whose
    # batch is ready from the carried-over groups opens none. Whether a turn is cut mid-generation depends on the
    # timing here: tests/unit/test_agent_stream.py cuts one deterministically.
    assert metrics[1]["agent_loop/finished_trajectories"] >= 8 and metrics[1]["agent_loop/engine_calls"] >= 2
    assert all(r["training/off_policy/trajectory_staleness_worst/max"] <= 1 for r in metrics.values())

    # The finished trajectories the checkpoint keeps: each with its mask (tool tokens 0) and its own prompt.
    shards = sorted((out / "checkpoints" / f"global_step_{STEPS}" / "replay_buffer").glob("shard*.pt"))
    assert len(shards) == 2  # each rank writes half of the (replicated) buffer
    for path in shards:
        shard = torch.load(path, weights_only=True)
        assert (shard["mask_lengths"] == shard["token_lengths"]).all() and (shard["prompt_lengths"] > 0).all()
        assert len(shard["masks"]) == 0 or (shard["masks"] == 0).any()

    run_train(cmd + [f"trainer.total_training_steps={STEPS + 2}"])
    resumed = read_metrics(out)
    assert sorted(resumed) == list(range(1, STEPS + 3))
    for record in (resumed[STEPS + 1], resumed[STEPS + 2]):
        assert record["training/off_policy/trajectory_staleness_worst/max"] <= 1
        assert record["response_length/max"] <= 64
    check_accounting(ledger(out), STEPS + 2, batch=4)


def test_colocate_async_agent_loops_at_rollout_tp2(tmp_path):
    """One rollout replica of TP 2 on the 2 training ranks: rank 0 runs the agent loops and the tools, rank 1 runs
    each of its engine calls on a thread beside the trainer's polls during a phase and is released at the pause;
    validation's loops run on the same group."""
    out, cmd = async_agent_cmd(
        tmp_path, "colocate_async", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.save_freq=-1", "trainer.test_freq=3", "trainer.total_training_steps=3", micro=8)
    run_train(cmd)
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2, 3]
    for step, record in metrics.items():
        assert 2 <= record["num_turns/min"] and record["num_turns/max"] <= 6, (step, record)
        assert record["tool_call_errors/max"] == 0 and record["response_length/max"] <= 64
    # the TP 2 rollout's log-probs are the TP 2 actor's on the sampled tokens (the tool tokens masked out)
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-3
    assert metrics[1]["agent_loop/engine_calls"] >= 2 and metrics[3]["val-aux/num_turns/max"] >= 2
    check_accounting(ledger(out), 3, batch=4)
