"""`verl train` with a classifier reward model of another architecture and tokenizer (issue 47, item 1): a DeBERTa-v2
RM with its own character tokenizer (another vocabulary order) scores the arithmetic actor's rollouts; every
sequence's score in the generations dump equals transformers' own forward of the decoded prompt and response."""

import json

import pytest
from helpers.reward_models import hf_score, save_reward_model
from helpers.tiny_models import arithmetic_data_args
from helpers.train_runs import read_metrics, run_train, train_cmd


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith"))


def test_deberta_rm_with_its_own_tokenizer_scores_reach_the_batch(tmp_path, arithmetic_data):
    from verl.workers.reward_model.plan import load_tokenizer

    rm_dir = str(tmp_path / "rm")
    model = save_reward_model(rm_dir, "deberta-v2", seed=5)
    out = tmp_path / "run"
    run_train(train_cmd(
        "grpo_arith_tiny.yaml", out, arithmetic_data, "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={rm_dir}", "reward_model.micro_batch_size_per_gpu=4",
        # A small step: 8 prompts x 2 responses.
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.rollout_data_dir={tmp_path / 'gens'}"))
    metrics = read_metrics(out)
    assert metrics[1]["reward_model/truncated_frac"] == 0.0
    records = [json.loads(line) for line in (tmp_path / "gens" / "1.jsonl").read_text().splitlines()]
    rm_tok = load_tokenizer(rm_dir, "rm")
    # An output that decodes empty (only the eos token) still has a token to carry its score.
    expected = [hf_score(model, rm_tok, r["input"], r["output"], "deberta-v2") for r in records]
    assert [r["score"] for r in records] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert metrics[1]["critic/score/mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-4, abs=1e-5)
    assert max(expected) != min(expected)
