"""`verl train` end to end on 2 local ranks (gloo, CPU, fp32, tiny Qwen2 on the arithmetic task).

- GRPO (TP=2, rollout TP=1: the hybrid engine all-gathers inside the micro-DP group) and PPO
  (critic + GAE; actor, reference and critic at TP=2 with sequence parallelism, verl's default for TP > 1)
  run from their quickstart configs and log every metric verl users expect;
- a GRPO run killed with SIGKILL after its step-2 checkpoint and restarted with
  ``trainer.resume_mode=auto`` (and verl's Megatron offload keys on) logs exactly the uninterrupted run's
  metrics for steps 3 and 4.
"""

import os

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.train_runs import (  # noqa: E402
    COMMON_KEYS,
    CRITIC_KEYS,
    VAL_KEYS,
    check_step_record,
    deterministic,
    read_metrics,
    run_train,
    run_until_step_then_kill,
    save_arith_reward_model,
    train_cmd,
)


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith"))










def test_grpo_two_ranks_logs_verl_metrics_and_resumes_exactly_after_kill(tmp_path, arithmetic_data):
    steps = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=4"]
    full_dir = tmp_path / "uninterrupted"
    run_train(train_cmd("grpo_arith_tiny.yaml", full_dir, arithmetic_data, *steps))
    full = read_metrics(full_dir)
    assert sorted(full) == [0, 1, 2, 3, 4]
    assert all(k in full[0] for k in VAL_KEYS), sorted(full[0])
    for step in (1, 2, 3, 4):
        check_step_record(full[step], step, COMMON_KEYS)
    assert all(k in full[4] for k in VAL_KEYS)
    assert os.path.isfile(full_dir / "metrics.csv")
    # The run's start-up: from the launch to the end of its first step (verl.launcher.startup), once.
    assert 0 < full[1]["perf/time_to_first_step_s"] < 600 and "perf/time_to_first_step_s" not in full[2]

    killed_dir = tmp_path / "killed"
    # Killed once step 3 is logged: the step-2 checkpoint is complete, step 4 not yet logged.
    run_until_step_then_kill(train_cmd("grpo_arith_tiny.yaml", killed_dir, arithmetic_data, *steps), killed_dir, 3)
    assert 4 not in read_metrics(killed_dir)
    assert (killed_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    # Resumed with verl's offload keys on: the actor's parameters, gradients and Adam state and the reference's
    # parameters wait in host memory while the rollout generates (engine.offload), and nothing else changes.
    offload = [f"actor_rollout_ref.actor.megatron.{key}=true" for key in ("param_offload", "grad_offload",
                                                                          "optimizer_offload")]
    offload.append("actor_rollout_ref.ref.megatron.param_offload=true")
    proc = run_train(train_cmd("grpo_arith_tiny.yaml", killed_dir, arithmetic_data, *steps, "trainer.resume_mode=auto",
                               *offload))
    assert "resumed from" in proc.stdout
    assert "startup: the first step ended " in proc.stdout
    resumed = read_metrics(killed_dir)
    assert resumed[3]["perf/time_to_first_step_s"] > 0  # the resumed run's own first step
    for step in (3, 4):
        assert resumed[step].pop("perf/offloaded_mb") > 0 and "perf/offloaded_mb" not in full[step]
        assert deterministic(resumed[step]) == deterministic(full[step]), f"step {step} differs after resume"


def test_ppo_two_ranks_trains_critic_with_gae(tmp_path, arithmetic_data):
    # TP=2 + sequence parallelism: the value head's output is split along the sequence until gathered (issue
    # 27); the config's DP=2 PPO layout runs in test_trainer_verl_keys.
    sequence_parallel = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                         "actor_rollout_ref.actor.megatron.sequence_parallel=true",
                         "critic.megatron.sequence_parallel=true"]
    run_train(train_cmd("ppo_arith_tiny.yaml", tmp_path, arithmetic_data, "trainer.total_training_steps=2",
                        "trainer.test_freq=2", "trainer.val_before_train=false", *sequence_parallel))
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        check_step_record(metrics[step], step, COMMON_KEYS + CRITIC_KEYS + ["actor/reward_kl_penalty"])
        assert metrics[step]["critic/vf_explained_var"] <= 1.0
    assert all(k in metrics[2] for k in VAL_KEYS)




def test_remax_with_reward_model_hot_swap_temperature_and_hf_export(tmp_path, arithmetic_data):
    """ReMax (greedy baselines) scored by a reward model that is swapped before step 2 for one whose
    head is zero; rollout temperature 0.7; the actor exported to actor_hf/ with its checkpoint."""
    import transformers

    save_arith_reward_model(tmp_path / "rm")
    save_arith_reward_model(tmp_path / "rm_zero", zero_head=True)
    out = tmp_path / "run"
    run_train(train_cmd(
        "grpo_arith_tiny.yaml", out, arithmetic_data, "algorithm.adv_estimator=remax",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.temperature=0.7",
        "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'rm'}",
        "reward_model.micro_batch_size_per_gpu=4", f"reward_model.hot_swap.path={tmp_path / 'rm_zero'}",
        "reward_model.hot_swap.at_step=2", "trainer.total_training_steps=2", "trainer.save_freq=2",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.export_hf_every_save=true"))
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        check_step_record(metrics[step], step, COMMON_KEYS + ["timing_s/gen_max", "timing_s/reward"])
        # old_log_probs are taken at the rollout temperature: the actor and the rollout agree.
        assert metrics[step]["training/rollout_probs_diff_max"] < 1e-4
    assert (metrics[1]["reward_model/swapped"], metrics[2]["reward_model/swapped"]) == (0.0, 1.0)
    assert metrics[1]["critic/score/max"] != metrics[1]["critic/score/min"]  # continuous model scores
    assert metrics[2]["critic/score/max"] == metrics[2]["critic/score/min"] == 0.0  # the zero head's

    export = out / "actor_hf"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"} <= set(
        os.listdir(export))
    assert not (out / "actor_hf.tmp").exists()
    transformers.AutoModelForCausalLM.from_pretrained(str(export))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    assert tokenizer.eos_token_id is not None
