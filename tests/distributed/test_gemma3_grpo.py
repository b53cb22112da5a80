"""GRPO on Gemma 3 270M end to end (issue 58): `verl train` with configs/grpo_gemma3_word_problems.yaml as it is
(Megatron actor at DP 2, native rollout TP 1, the 3D-HybridEngine between them), truncated to two steps of a tiny
batch and 6 new tokens. Checks that both steps train (an optimizer step with a finite loss and gradient on rollouts
the word-problem scorer scored) and that the rollout's log-probs are the actor's: the on-policy shortcut's
weight-sync check (actor's forward vs the rollout's sampling log-probs) stays within fp32 noise after the step's
reshard."""

import math
import subprocess
import sys

import pytest
from helpers.gemma3_model import gemma3_dir, log_prob_tolerance_fp32
from helpers.train_runs import REPO, read_metrics, train_env

pytestmark = pytest.mark.distributed


def test_two_truncated_grpo_steps_on_gemma3(tmp_path):
    model_dir = gemma3_dir()
    data = tmp_path / "data"
    from verl.utils.dataset.word_problems import main as word_problems  # `verl data word-problems`, in process

    assert word_problems(["--out", str(data), "--num-train", "16", "--num-test", "4", "--num-test-ood", "0",
                          "--prompt-format", "fewshot"]) == 0  # the quickstart's choice for a base model
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "verl.cli", "train", "--config", "configs/grpo_gemma3_word_problems.yaml",
           f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet",
           f"actor_rollout_ref.model.path={model_dir}", f"trainer.output_dir={out}",
           "data.max_response_length=6", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=2",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=1e-4",
           # a 6-token answer scores 0 everywhere (no advantage): the entropy bonus gives every step a gradient
           "actor_rollout_ref.actor.entropy_coeff=0.01",
           "trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false",
           "trainer.logger=[console]"]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2], sorted(metrics)
    for step in (1, 2):
        record = metrics[step]
        assert record["response_length/max"] <= 6
        assert 0.0 <= record["critic/score/mean"] <= 1.0
        assert math.isfinite(record["actor/pg_loss"]) and math.isfinite(record["actor/grad_norm"])
        assert record["actor/grad_norm"] > 0
        # the rollout sampled with the weights the actor holds (the step's reshard, after step 1's update at step 2):
        # fp32 on both sides, so their log-probs differ by summation order only (this checkpoint's logits stay below
        # 30 in magnitude on such prompts; a stale or wrong weight moves them by whole nats)
        assert record["training/rollout_log_probs_diff_max"] <= log_prob_tolerance_fp32(30.0)
