"""`verl train` with ``rollout.multi_turn.enable`` under ``trainer.v1.trainer_mode=colocate_async`` (issue 46 item 4):
tool_agent trajectories that live across steps in the replay buffer, on 2 ranks (2 rollout replicas, each running
its own agent loops). Turns end on ~1 token in 8 (tests/helpers/forced_tool_calls.py, ``test_random_length_calls``).
A second run resumes from the checkpoint of step 3: the finished agent trajectories left in the replay buffer come
back from its shards (masks and prompts included) and step 4 trains them; step 5's phase starts new loops."""

import pytest
from helpers.chat_models import save_chat_model
from helpers.train_runs import read_metrics, run_train, train_cmd
from test_agent_loop_train import write_data

pytestmark = pytest.mark.distributed

STEPS = 3  # then two more after the resume


def test_colocate_async_trains_agent_trajectories_that_span_weight_syncs(tmp_path):
    model = save_chat_model(str(tmp_path / "model"), seed=3)
    write_data(tmp_path / "train.parquet", [(a, b) for a in range(2, 8) for b in range(3, 6)])
    write_data(tmp_path / "val.parquet", [(2, 3), (5, 5)])
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.calculator.CalculatorTool\n    config: {type: native}\n")
    out = tmp_path / "run"
    cmd = train_cmd(
        "grpo_arith_tiny.yaml", out, [f"data.train_files={tmp_path}/train.parquet",
                                      f"data.val_files={tmp_path}/val.parquet", f"data.tokenizer={model}"],
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.external_lib=tests.helpers.forced_tool_calls",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.format=test_random_length_calls",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async",
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.max_prompt_length=48", "data.max_response_length=64",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "trainer.save_freq=3", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.resume_mode=auto")
    run_train(cmd + [f"trainer.total_training_steps={STEPS}"])
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, record in metrics.items():
        assert record["num_turns/max"] <= 6 and record["tool_call_counts/max"] <= 2, (step, record)
        assert record["tool_call_errors/max"] == 0
        # the trained tokens are the sampled ones only: tool answers and template deltas are masked out
        assert record["response_length/max"] <= 64
    # Step 1 trains trajectories sampled on version 0 only: the rollout's log-probs are the actor's on the
    # sampled tokens (the weight-sync check; the tool tokens masked out).
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-4
    # The phases: step 1's ran until a batch was ready (the warm-up batch's groups in flight too); a step whose
    # batch is ready from the carried-over groups opens none. Whether a turn is cut mid-generation depends on the
    # timing here: tests/unit/test_agent_stream.py cuts one deterministically.
    assert metrics[1]["agent_loop/finished_trajectories"] >= 8 and metrics[1]["agent_loop/engine_calls"] >= 3
    assert all(r["training/off_policy/trajectory_staleness_worst/max"] <= 1 for r in metrics.values())

    run_train(cmd + [f"trainer.total_training_steps={STEPS + 2}"])
    resumed = read_metrics(out)
    assert sorted(resumed) == list(range(1, STEPS + 3))
    restored, fresh = resumed[STEPS + 1], resumed[STEPS + 2]
    assert restored["agent_loop/engine_calls"] == 0  # its batch: the restored finished trajectories
    assert fresh["agent_loop/finished_trajectories"] >= 8
    for record in (restored, fresh):
        assert record["training/off_policy/trajectory_staleness_worst/max"] <= 1
        assert record["response_length/max"] <= 64
