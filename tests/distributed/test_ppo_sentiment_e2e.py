"""The documents' PPO workload end to end (issue 47, item 4): actor + critic + reference (a tiny Qwen2 on Megatron)
and a BERT classifier reward model with its own tokenizer on the generated sentiment task, 2 ranks, 2 steps: it runs
with all four models, and each one's memory and the phases' times are in the step metrics."""

from helpers.train_runs import read_metrics, run_train, train_cmd


def test_ppo_sentiment_runs_with_actor_critic_reference_and_a_bert_rm(tmp_path):
    from verl.data.sentiment import train_rm, write_sentiment

    data = tmp_path / "sentiment"
    write_sentiment(str(data), num_train=32, num_test=8, rm=False, judge=False)
    train_rm(str(data / "rm"), steps=0)  # an untrained BERT: the test checks the wiring, not the learning
    out = tmp_path / "run"
    run_train(train_cmd(
        "ppo_sentiment_rm.yaml", out,
        [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
         f"data.tokenizer={data / 'tokenizer'}", f"reward.reward_model.model_path={data / 'rm'}"],
        "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "critic.ppo_mini_batch_size=16", "reward_model.micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=2"))
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        record = metrics[step]
        assert "memory/rollout_gb" in record  # 0 at the step's end: the rollout released its memory
        for role in ("actor", "ref", "critic", "reward_model"):
            assert record[f"memory/{role}_gb"] > 0, role
        for phase in ("gen", "reward", "old_log_prob", "ref", "values", "update_critic", "update_actor"):
            assert record[f"timing_s/{phase}"] > 0, phase
        assert record["reward_model/truncated_frac"] == 0.0
    # Adam's two states and the gradients: the trained models hold more than the forward-only ones.
    assert metrics[2]["memory/actor_gb"] > 2 * metrics[2]["memory/ref_gb"]
    assert metrics[2]["memory/critic_gb"] > 2 * metrics[2]["memory/ref_gb"]
