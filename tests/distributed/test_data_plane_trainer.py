"""`verl train` on the distributed data plane (``transfer_queue.enable=true``) against the legacy path, 2 ranks.

PPO with a critic and the KL penalty in the reward (GAE whitens the advantages over the whole batch: on the
data plane from summed statistics), with validation. (GRPO with actor TP 2 and rollout TP 1, where rows move
between the rollout's and the actor's replicas, is compared on the runs of `verl bench dispatch`:
tests/distributed/test_bench_train.py.) Same seed, same data: every loss, gradient
norm and learning rate of every step, the validation accuracy and the scores are equal bit for bit; the
metrics the controller reduces over tokens (entropy, advantage / return / value means, the rollout-probs
diff, explained variance) are equal within their summation-order bound; and the data plane reports what it
moved.
"""

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.train_runs import assert_same_run_on_both_paths, read_metrics, run_train, train_cmd  # noqa: E402

pytestmark = pytest.mark.distributed


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


def test_ppo_with_gae_and_kl_in_reward_on_the_data_plane_equals_the_legacy_path(tmp_path, arithmetic_data):
    legacy, sharded = _runs(tmp_path, arithmetic_data, "ppo_arith_tiny.yaml", "trainer.total_training_steps=2",
                            "trainer.test_freq=2", "algorithm.use_kl_in_reward=true")
    assert_same_run_on_both_paths(legacy, sharded)
    assert "critic/vf_explained_var" in sharded[2] and "actor/reward_kl_penalty" in sharded[2]
