"""The on-policy shortcut (issue 17): verl's ``algorithm.rollout_correction.bypass_mode`` skips the separate
old-log-prob forward, and an on-policy update (one PPO epoch, one mini-batch) uses the current log-probs,
detached, as the old ones (verl's actor). A GRPO run with the shortcut logs the same losses and gradient
norms as the full path, step by step, without an ``old_log_prob`` phase."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "configs", "grpo_arith_tiny.yaml")
SAME = ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/kl_loss", "critic/score/mean")


def run(tmp_path, data_args, name, *overrides):
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "--config", GRPO, *data_args,
         "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
         "trainer.save_freq=-1", "trainer.export_hf_at_end=false", "data.train_batch_size=16",
         "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
         "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64", f"trainer.output_dir={out}", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_bypass_mode_matches_the_full_path_on_policy(tmp_path):
    data_args = arithmetic_data_args(tmp_path / "data")
    full = run(tmp_path, data_args, "full")
    bypass = run(tmp_path, data_args, "bypass", "algorithm.rollout_correction.bypass_mode=true")
    assert [r["step"] for r in full] == [r["step"] for r in bypass] == [1, 2]
    for a, b in zip(full, bypass, strict=True):
        assert "timing_s/old_log_prob" in a and "timing_s/old_log_prob" not in b
        for key in SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key, a[key], b[key])
