"""`verl train` with ``rollout.multi_turn.enable`` on vLLM (issue 55 item 5): verl's tool_agent loops through the
batching token server over vLLM (the turns in flight batched into one generate call with per-row budgets; vLLM's
prefix cache holds each trajectory between turns), in the synchronous trainer and in colocate_async (turns cut by
the weight sync between rounds and resumed on the new weights, each segment tagged with its version). The tiny chat
model with 2 heads of 64 (vLLM's CPU attention takes head_dim >= 32); turns end on ~1 token in 8
(tests/helpers/forced_tool_calls.py)."""

import subprocess

import pytest
from helpers.agent_runs import agent_train_cmd, async_agent_cmd
from helpers.train_runs import REPO, check_accounting, ledger, read_metrics, train_env

RUN_TIMEOUT_S = 420
STEPS = 3
WIDE_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 32
COMMON = ["actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=1",
          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.save_freq=-1",
          f"trainer.test_freq={STEPS}", f"trainer.total_training_steps={STEPS}"]


def command(tmp_path, mode, python):
    if mode == "sync":
        return agent_train_cmd(
            tmp_path, [(a, b) for a in range(2, 8) for b in range(3, 6)], "test_random_length_calls",
            "trainer.val_before_train=false", "data.max_prompt_length=48", "data.max_response_length=64",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", *COMMON, python=python,
            model_changes=WIDE_HEADS)
    return async_agent_cmd(tmp_path, mode, "actor_rollout_ref.actor.ppo_mini_batch_size=4", *COMMON, python=python,
                           model_changes=WIDE_HEADS)


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_vllm_agent_loops_train(vllm_python, tmp_path, mode):
    out, cmd = command(tmp_path, mode, vllm_python)
    proc = subprocess.run(cmd, cwd=REPO, env={**train_env(), "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, record in metrics.items():
        assert 2 <= record["num_turns/min"] and record["num_turns/max"] <= 6, (step, record)
        assert record["tool_call_errors/max"] == 0 and record["response_length/max"] <= 64
    # Step 1 trains trajectories vLLM sampled on version 0: their log-probs are the actor's on the sampled tokens
    # (the tool tokens masked out).
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-3
    assert metrics[STEPS]["val-aux/num_turns/max"] >= 2  # validation ran tool_agent loops on the same engine
    if mode == "colocate_async":
        for record in metrics.values():
            assert record["training/off_policy/trajectory_staleness_worst/max"] <= 1
        check_accounting(ledger(out), STEPS, batch=4)
