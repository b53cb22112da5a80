"""`verl train` with ``rollout.multi_turn.enable`` on vLLM (issue 55 item 5): verl's tool_agent loops through the
batching token server over vLLM (the turns in flight batched into one generate call with per-row budgets; vLLM's
prefix cache holds each trajectory between turns), in colocate_async: turns cut by the weight sync between rounds
and resumed on the new weights, each segment tagged with its version (the sync trainer's turns take the same
server, never cut). The tiny chat model with 2 heads of 32 dims (vLLM's CPU attention takes head_dim >= 32); turns
end on ~1 token in 8 (tests/helpers/forced_tool_calls.py)."""

import subprocess

from helpers.agent_runs import async_agent_cmd
from helpers.train_runs import REPO, check_accounting, ledger, read_metrics, train_env

RUN_TIMEOUT_S = 420
STEPS = 3
WIDE_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 32
COMMON = ["actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=1",
          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.save_freq=-1",
          f"trainer.test_freq={STEPS}", f"trainer.total_training_steps={STEPS}"]


def test_vllm_agent_loops_train_across_weight_syncs(vllm_python, tmp_path):
    out, cmd = async_agent_cmd(tmp_path, "colocate_async", "actor_rollout_ref.actor.ppo_mini_batch_size=4", *COMMON,
                               python=vllm_python, model_changes=WIDE_HEADS)
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
    for record in metrics.values():
        assert record["training/off_policy/trajectory_staleness_worst/max"] <= 1
    check_accounting(ledger(out), STEPS, batch=4)
