"""The on-policy shortcuts (issues 17 and 60): an on-policy update (one PPO epoch, one mini-batch) uses the current
log-probs, detached, as the old ones (verl's actor), so by default (``actor.recompute_on_policy_old_log_prob=false``)
the separate old-log-prob forward does not run: the update's own forward returns them, with the entropy, for
``actor/entropy`` and the weight-sync check. verl's ``algorithm.rollout_correction.bypass_mode`` skips it too (the
rollout's log-probs as the old ones). Each logs the same losses and gradient norms as verl's full path (the
recompute), step by step, without an ``old_log_prob`` phase; two mini-batches keep the phase."""

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


RECOMPUTE = "actor_rollout_ref.actor.recompute_on_policy_old_log_prob=true"
# actor/entropy and the sync check's maxima, from the update's forward instead of a pass of their own: the same rows
# through the same weights in other micro-batches (fp32; the entropy a mean of ~3.4 nats over a few hundred tokens)
FROM_UPDATE = {"actor/entropy": 1e-5, "training/rollout_probs_diff_max": 1e-6,
               "training/rollout_log_probs_diff_max": 1e-5}


def test_the_shortcuts_match_the_full_path_on_policy(tmp_path):
    data_args = arithmetic_data_args(tmp_path / "data")
    full = run(tmp_path, data_args, "full", RECOMPUTE)
    default = run(tmp_path, data_args, "default")
    bypass = run(tmp_path, data_args, "bypass", "algorithm.rollout_correction.bypass_mode=true")
    assert [r["step"] for r in full] == [r["step"] for r in default] == [r["step"] for r in bypass] == [1, 2]
    for a, d, b in zip(full, default, bypass, strict=True):
        assert "timing_s/old_log_prob" in a
        assert "timing_s/old_log_prob" not in b and "timing_s/old_log_prob" not in d
        for key in SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key, a[key], b[key])
            assert d[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key, a[key], d[key])
        for key, tol in FROM_UPDATE.items():
            assert d[key] == pytest.approx(a[key], rel=tol, abs=tol), (a["step"], key, a[key], d[key])


def test_two_mini_batches_keep_the_old_log_prob_pass(tmp_path):
    """The second mini-batch's update runs on weights the first changed: its old log-probs must be recomputed."""
    rows = run(tmp_path, arithmetic_data_args(tmp_path / "data"), "two_minis",
               "actor_rollout_ref.actor.ppo_mini_batch_size=8",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16")
    assert all("timing_s/old_log_prob" in r and "actor/entropy" in r for r in rows)
