"""The real-model RL job (configs/grpo_smollm2_gsm.yaml), truncated: `verl train` on SmolLM2-135M-Instruct
(tests/helpers/real_model.py) for one GRPO step on 2 ranks with a tiny batch and 8 new tokens, validation before
and after. Checks that the job's own config runs as it is (Megatron actor, native rollout, bypass of the old
log-prob pass), that the prompts reach the model through its ChatML template in training and validation, and that
the word-problem scorer is what scores both."""

import json
import subprocess
import sys

import pytest
from helpers.real_model import smollm2_dir
from helpers.train_runs import REPO, read_metrics, train_env

from verl.utils.reward_score.word_problems import compute_score

SYSTEM_TURN = "You are a helpful AI assistant named SmolLM"  # the template's default system turn


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_dir()


def test_one_truncated_grpo_step_on_the_real_checkpoint(tmp_path, model_dir):
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "verl.cli", "data", "word-problems", "--out", str(data), "--num-train",
                    "16", "--num-test", "4"], check=True, cwd=REPO, env=train_env(), capture_output=True)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "verl.cli", "train", "--config", "configs/grpo_smollm2_gsm.yaml",
           f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet",
           f"actor_rollout_ref.model.path={model_dir}", f"trainer.output_dir={out}",
           "data.max_response_length=8", "data.train_batch_size=2", "data.val_batch_size=4",
           "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
           "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "trainer.total_training_steps=1",
           "trainer.test_freq=1",
           "trainer.save_freq=0", "trainer.export_hf_at_end=false", "trainer.logger=[console]",
           f"trainer.rollout_data_dir={tmp_path / 'rollouts'}", f"trainer.validation_data_dir={tmp_path / 'val'}"]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]

    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1]
    step = metrics[1]
    assert "critic/score/mean" in step and "timing_s/old_log_prob" not in step  # rollout_correction.bypass_mode
    assert step["response_length/max"] <= 8
    for record in (metrics[0], step):
        assert record["val/num_samples"] == 4.0
        assert record["val-core/word_problems/reward/mean@1"] == record["val/accuracy"]

    for dump, rows in ((tmp_path / "rollouts" / "1.jsonl", 4), (tmp_path / "val" / "1.jsonl", 4)):
        records = [json.loads(line) for line in dump.read_text().splitlines()]
        assert len(records) == rows
        for record in records:
            assert record["input"].startswith("system\n" + SYSTEM_TURN), record["input"]  # ChatML, specials dropped
            assert record["input"].rstrip().endswith('End with "The answer is N."\nassistant'), record["input"]
            assert record["score"] == compute_score(record["output"], record["gts"])
    train_scores = [json.loads(line)["score"] for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert step["critic/score/mean"] == pytest.approx(sum(train_scores) / len(train_scores))
