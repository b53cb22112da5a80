"""`verl train` accepts an advantage estimator and a policy loss a recipe's module registers: the module named by
``actor_rollout_ref.model.external_lib`` (verl's key) is imported by the launcher and every rank before the
config's registered names are checked, and the run uses them (one GRPO step on 2 local ranks)."""

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.toy_recipe import ADVANTAGE, LOSS  # noqa: E402
from helpers.train_runs import read_metrics, run_train, train_cmd  # noqa: E402

RECIPE = ["actor_rollout_ref.model.external_lib=tests.helpers.toy_recipe", "algorithm.adv_estimator=toy_constant",
          "actor_rollout_ref.actor.policy_loss.loss_mode=toy_constant"]


def test_a_recipes_estimator_and_loss_run_through_verl_train(tmp_path):
    data = arithmetic_data_args(tmp_path / "arith")
    run_train(train_cmd("grpo_arith_tiny.yaml", tmp_path / "out", data, *RECIPE, "trainer.total_training_steps=1",
                        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1"))
    step = read_metrics(tmp_path / "out")[1]
    assert step["critic/advantages/mean"] == pytest.approx(ADVANTAGE)
    batches = round(step["actor/pg_loss"] / LOSS)  # a vanilla loss of a tiny model is nowhere near 37
    assert batches >= 1 and step["actor/pg_loss"] == pytest.approx(batches * LOSS)


def test_without_the_module_the_names_are_one_line_listing_the_registered_ones(tmp_path):
    import subprocess

    from helpers.train_runs import REPO, train_env

    data = arithmetic_data_args(tmp_path / "arith")
    cmd = train_cmd("grpo_arith_tiny.yaml", tmp_path / "out", data, RECIPE[1], "--cfg", "job")
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "algorithm.adv_estimator: expected one of ['gae', 'grpo', " in lines[0], proc.stderr
    assert lines[0].endswith("found 'toy_constant'")
