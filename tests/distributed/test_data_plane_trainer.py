"""`verl train` on the distributed data plane (``transfer_queue.enable=true``) against the legacy path, 2 ranks.

GRPO from its quickstart config (actor TP 2, rollout TP 1: the rollout's and the actor's replicas differ, so
rows move between them) and PPO with a critic and the KL penalty in the reward (GAE whitens the advantages
over the whole batch: on the data plane from summed statistics). Same seed, same data: every loss, gradient
norm and learning rate of every step, the validation accuracy and the scores are equal bit for bit; the
metrics the controller reduces over tokens (entropy, advantage / return / value means, the rollout-probs
diff, explained variance) are equal within their summation-order bound; and the data plane reports what it
moved.
"""

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.train_runs import NONDETERMINISTIC_PREFIXES, read_metrics, run_train, train_cmd  # noqa: E402

pytestmark = pytest.mark.distributed

EPS32 = 2.0**-24  # float32's unit roundoff
# Keys the controller reduces over a batch's tokens: the legacy path in float32 over the whole tensor, the data
# plane in float64 from per-row sums. Their difference is bounded by the float32 reduction's error,
# tokens * EPS32 * (largest magnitude summed); the largest magnitude comes from the metric's own max/min keys
# (or the value itself where there are none).
REDUCED = {"actor/entropy": None, "critic/advantages/mean": "critic/advantages",
           "critic/returns/mean": "critic/returns", "critic/values/mean": "critic/values",
           "critic/rewards/mean": "critic/rewards", "critic/score/mean": "critic/score",
           "training/rollout_probs_diff_mean": "training/rollout_probs_diff",
           "training/rollout_probs_diff_std": "training/rollout_probs_diff",
           "critic/vf_explained_var": None, "actor/reward_kl_penalty": None}
DATA_PLANE_KEYS = ("perf/data_plane_received_mb", "perf/data_plane_object_mb", "perf/data_plane_shard_mb",
                   "perf/data_plane_seconds", "perf/data_plane_peak_rss_mb")


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith"))


def _runs(tmp_path, data, config, *overrides):
    out = {}
    for enable in ("false", "true"):
        run_train(train_cmd(config, tmp_path / enable, data, "trainer.save_freq=-1", f"transfer_queue.enable={enable}",
                            *overrides))
        out[enable] = read_metrics(tmp_path / enable)
    return out["false"], out["true"]


def _bound(record, key):
    tokens = record["perf/total_num_tokens"]
    prefix = REDUCED[key]
    scale = max(abs(record[f"{prefix}/max"]), abs(record[f"{prefix}/min"])) if prefix and \
        f"{prefix}/max" in record else abs(record[key])
    if key == "critic/vf_explained_var":  # 1 - a ratio of two variances, each with the reduction's error
        scale = 2 * max(1.0, abs(1.0 - record[key]))
    return 4 * tokens * EPS32 * scale


def _compare(legacy, sharded):
    assert sorted(legacy) == sorted(sharded)
    for step in legacy:
        a, b = legacy[step], sharded[step]
        assert set(b) - set(a) == (set(DATA_PLANE_KEYS) if step else set()), step
        if step:
            assert b["perf/data_plane_object_mb"] > 0
        for key in a:
            if key.startswith(NONDETERMINISTIC_PREFIXES) or key in DATA_PLANE_KEYS:
                continue
            if key in REDUCED:
                assert abs(a[key] - b[key]) <= _bound(a, key), (step, key, a[key], b[key], _bound(a, key))
            else:
                assert a[key] == b[key], (step, key, a[key], b[key])


def test_grpo_on_the_data_plane_equals_the_legacy_path(tmp_path, arithmetic_data):
    legacy, sharded = _runs(tmp_path, arithmetic_data, "grpo_arith_tiny.yaml", "trainer.total_training_steps=3",
                            "trainer.test_freq=3")
    _compare(legacy, sharded)
    assert "val/accuracy" in sharded[3]
    # Rollout replicas (TP 1: one per rank) and actor replicas (TP 2: one over both ranks) differ: rows move.
    assert all(sharded[step]["perf/data_plane_received_mb"] > 0 for step in (1, 2, 3))


def test_ppo_with_gae_and_kl_in_reward_on_the_data_plane_equals_the_legacy_path(tmp_path, arithmetic_data):
    legacy, sharded = _runs(tmp_path, arithmetic_data, "ppo_arith_tiny.yaml", "trainer.total_training_steps=2",
                            "trainer.test_freq=2", "algorithm.use_kl_in_reward=true")
    _compare(legacy, sharded)
    assert "critic/vf_explained_var" in sharded[2] and "actor/reward_kl_penalty" in sharded[2]
