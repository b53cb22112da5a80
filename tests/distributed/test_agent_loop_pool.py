"""`verl train` with ``rollout.multi_turn.enable`` under ``trainer.v1.trainer_mode=separate_async`` (issue 46 item 4):
tool_agent trajectories on a standalone rollout pool, streaming across the weight syncs. The pool is one native
replica of rollout TP 2: its rank 0 runs the agent loops and the tools, rank 1 follows its engine calls and, when
rank 0 releases it at a command, takes the same command (rank 1's commands arrive 0.3 s late: fault injection, so
the release waits for them). Validation's agent loops run on the pool too. Turns end on ~1 token in 8
(tests/helpers/forced_tool_calls.py), so a weight sync may cut a turn; tests/unit/test_agent_stream.py cuts one
deterministically."""

import pytest
from helpers.agent_runs import async_agent_cmd
from helpers.train_runs import check_accounting, ledger, read_metrics, run_train

pytestmark = pytest.mark.distributed

STEPS = 3


def test_separate_async_pool_streams_agent_trajectories_across_syncs(tmp_path):
    out, cmd = async_agent_cmd(
        tmp_path, "separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1", f"trainer.test_freq={STEPS}", micro=2)
    run_train(cmd, env={"VERL_TEST_POOL_COMMAND_DELAY": "1:0.3"})
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, record in metrics.items():
        assert record["num_turns/max"] <= 6 and record["tool_call_counts/max"] <= 2, (step, record)
        assert record["num_turns/min"] >= 2 and record["tool_call_errors/max"] == 0
        assert record["response_length/max"] <= 64  # the trained (mask 1) tokens, within the budget
    # Every trained trajectory came back from the pool (a step counts those it received while it waited).
    assert sum(r.get("agent_loop/finished_trajectories", 0) for r in metrics.values()) >= STEPS * 4 * 2
    print({step: {k: v for k, v in r.items() if k.startswith(("agent_loop", "training/off_policy/partial",
                                                              "num_turns", "val-aux"))} for step, r in metrics.items()})
    # Step 1's first mini-batch was sampled on version 0 only, by the pool's TP 2 shards: its log-probs are the
    # actor's on the sampled tokens (the weight-sync check; the tool tokens masked out).
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-3
    # Validation ran tool_agent loops on the pool (a single-turn rollout reports no turns).
    assert metrics[STEPS]["val-aux/num_turns/max"] >= 2
    check_accounting(ledger(out), STEPS, batch=4)
