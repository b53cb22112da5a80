"""`verl train` on the FSDP backend end to end (2 local gloo ranks, CPU, fp32, tiny Qwen2, arithmetic task).

- GRPO from configs/grpo_arith_tiny_fsdp.yaml logs verl's metrics (the phases adding up to the step) and a
  run killed with SIGKILL after its step-2 checkpoint, restarted with ``trainer.resume_mode=auto``, logs
  exactly the uninterrupted run's metrics for steps 3 and 4;
- the same 2-rank checkpoint resumes on 1 rank (DCP reshards model and optimizer), which trains on;
- PPO with a critic (GAE) on FSDP trains both models.
"""

import os

import pytest
from helpers.tiny_models import arithmetic_data_args
from helpers.train_runs import (
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

pytestmark = pytest.mark.distributed
CONFIG = "grpo_arith_tiny_fsdp.yaml"


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith_fsdp"))


def test_fsdp_grpo_logs_metrics_resumes_after_kill_and_on_one_rank(tmp_path, arithmetic_data):
    steps = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=4"]
    full_dir = tmp_path / "uninterrupted"
    run_train(train_cmd(CONFIG, full_dir, arithmetic_data, *steps))
    full = read_metrics(full_dir)
    assert sorted(full) == [0, 1, 2, 3, 4]
    assert all(k in full[0] for k in VAL_KEYS)
    for step in (1, 2, 3, 4):
        check_step_record(full[step], step, COMMON_KEYS)
    manifest = (full_dir / "checkpoints" / "global_step_2" / "actor" / "verl_checkpoint.json").read_text()
    assert '"strategy": "fsdp"' in manifest

    killed_dir = tmp_path / "killed"
    run_until_step_then_kill(train_cmd(CONFIG, killed_dir, arithmetic_data, *steps), killed_dir, 3)
    assert 4 not in read_metrics(killed_dir)
    proc = run_train(train_cmd(CONFIG, killed_dir, arithmetic_data, *steps, "trainer.resume_mode=auto"))
    assert "resumed from" in proc.stdout
    resumed = read_metrics(killed_dir)
    for step in (3, 4):
        assert deterministic(resumed[step]) == deterministic(full[step]), f"step {step} differs after resume"

    # The 2-rank run's step-2 checkpoint on 1 rank: DCP reshards the model and Adam state onto one shard.
    one_dir = tmp_path / "one_rank"
    os.makedirs(one_dir)
    proc = run_train(train_cmd(CONFIG, one_dir, arithmetic_data, *steps[:2], "trainer.test_freq=-1",
                               "trainer.n_gpus_per_node=1", "trainer.resume_mode=resume_path",
                               f"trainer.resume_from_path={full_dir / 'checkpoints' / 'global_step_2'}"))
    assert "resumed from" in proc.stdout
    one = read_metrics(one_dir)
    assert sorted(one) == [3, 4]
    for step in (3, 4):
        check_step_record(one[step], step, COMMON_KEYS)


def test_fsdp_ppo_trains_critic_with_gae_scored_by_a_swapped_reward_model(tmp_path, arithmetic_data):
    """The PPO quickstart config with one switch: every role (actor, critic, reference, reward model) follows
    the actor's strategy. The reward model (an HF sequence-classification checkpoint) is swapped before step 2
    for one whose head is zero."""
    save_arith_reward_model(tmp_path / "rm")
    save_arith_reward_model(tmp_path / "rm_zero", zero_head=True)
    out = tmp_path / "run"
    run_train(train_cmd("ppo_arith_tiny.yaml", out, arithmetic_data, "actor_rollout_ref.actor.strategy=fsdp",
                        "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'rm'}",
                        "reward_model.micro_batch_size_per_gpu=4", f"reward_model.hot_swap.path={tmp_path / 'rm_zero'}",
                        "reward_model.hot_swap.at_step=2", "trainer.total_training_steps=2", "trainer.test_freq=-1",
                        "trainer.save_freq=2", "trainer.val_before_train=false"))
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        check_step_record(metrics[step], step, COMMON_KEYS + CRITIC_KEYS + ["actor/reward_kl_penalty"])
        assert metrics[step]["critic/vf_explained_var"] <= 1.0
    assert metrics[1]["critic/score/max"] != metrics[1]["critic/score/min"]  # continuous model scores
    assert metrics[2]["critic/score/max"] == metrics[2]["critic/score/min"] == 0.0  # the zero head's
    manifest = (out / "checkpoints" / "global_step_2" / "critic" / "verl_checkpoint.json").read_text()
    assert '"strategy": "fsdp"' in manifest and '"head": "value"' in manifest
