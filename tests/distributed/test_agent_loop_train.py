"""`verl train` with ``rollout.multi_turn.enable`` (issue 46): GRPO steps whose rollouts are tool_agent trajectories on
the native engine, the calculator loaded from verl's tool YAML, rows' ``agent_name`` passed through the dataset.
A random tiny model never writes a well-formed tool call, so the tool-call format is the test's (every turn one
token, read as a calculator call: tests/helpers/forced_tool_calls.py, loaded by ``external_lib``); the token-level
alignment of mask and log-probs is tests/unit/test_agent_loop_native.py's."""

import json

import pytest
from helpers.agent_runs import agent_train_cmd
from helpers.train_runs import read_metrics, run_train

pytestmark = pytest.mark.distributed


# 1 rank; 2 ranks with rollout TP 2 (rank 0 runs the loops and tools, rank 1 follows its engine calls); and 1
# training rank with a standalone rollout pool of 1 rank, which runs the loops for the sync trainer.
@pytest.mark.parametrize("ranks,pool", [(1, 0), (2, 0), (1, 1)], ids=["1rank", "2ranks-tp2", "pool"])
def test_grpo_with_tool_agent_trajectories(tmp_path, ranks, pool):
    out, cmd = agent_train_cmd(
        tmp_path, [(6, 7), (12, 3), (9, 9), (4, 8)], "test_every_turn_calls",
        f"trainer.n_gpus_per_node={ranks}", f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={ranks}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={ranks}",
        *(["actor_rollout_ref.rollout.nnodes=1", f"actor_rollout_ref.rollout.n_gpus_per_node={pool}"] if pool else []),
        "data.max_prompt_length=48", "data.max_response_length=64",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.rollout_data_dir={tmp_path / 'gens'}")
    run_train(cmd)
    step = read_metrics(out)[1]
    # user, then 3 assistant turns with 2 tool answers between them, as verl counts turns
    assert step["num_turns/min"] == step["num_turns/max"] == 6
    assert step["tool_call_counts/mean"] == 2 and step["tool_call_errors/max"] == 0
    # the 8 trajectories' turns ran batched: one engine call per turn
    assert step["agent_loop/engine_calls"] == 3
    # the rollout's log-probs are the actor's own on the sampled tokens (the tool tokens masked out)
    assert step["training/rollout_probs_diff_max"] < 1e-4
    # response_length counts response_mask: only the 3 sampled tokens of each trajectory, not the tool answers
    assert step["response_length/mean"] == step["response_length/max"] == 3
    records = [json.loads(line) for line in (tmp_path / "gens" / "1.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all("tool42" in r["output"].replace("\n", "") for r in records
                                     if "6*7" in r["input"])
