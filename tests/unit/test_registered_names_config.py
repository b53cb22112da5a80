"""algorithm.adv_estimator and actor.policy_loss.loss_mode are checked against the live registries, after the
module ``actor_rollout_ref.model.external_lib`` names is imported (issue 42 item 4)."""

import os
import sys

import pytest

from verl.algorithms import core_algos
from verl.trainer.config.ppo import load_config
from verl.utils.config_checks import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "grpo_arith_tiny.yaml")


def _load(*overrides):
    return load_config(CONFIG, list(overrides), resolve_only=True)


@pytest.mark.parametrize("key, registry", [("algorithm.adv_estimator", core_algos.ADV_ESTIMATOR_REGISTRY),
                                           ("actor_rollout_ref.actor.policy_loss.loss_mode",
                                            core_algos.POLICY_LOSS_REGISTRY)])
def test_an_unknown_name_is_one_line_listing_the_registered_ones(key, registry):
    with pytest.raises(ConfigError) as err:
        _load(f"{key}=nope")
    assert str(err.value) == f"{key}: expected one of {sorted(registry)}, found 'nope'"


def test_names_registered_after_import_are_accepted_and_listed():
    core_algos.register_adv_est("late_estimator")(core_algos.compute_grpo_outcome_advantage)
    core_algos.register_policy_loss("late_loss")(core_algos.compute_policy_loss_vanilla)
    try:
        cfg = _load("algorithm.adv_estimator=late_estimator", "actor_rollout_ref.actor.policy_loss.loss_mode=late_loss")
        assert (cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.actor.policy_loss.loss_mode) == (
            "late_estimator", "late_loss")
        with pytest.raises(ConfigError, match=r"expected one of \[.*'late_estimator'.*\], found 'nope'"):
            _load("algorithm.adv_estimator=nope")
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop("late_estimator")
        core_algos.POLICY_LOSS_REGISTRY.pop("late_loss")


def test_external_lib_is_imported_before_the_names_are_checked(tmp_path, monkeypatch):
    (tmp_path / "my_recipe_h42.py").write_text(
        "from verl.algorithms.core_algos import compute_grpo_outcome_advantage, register_adv_est\n"
        "register_adv_est('my_recipe_h42_adv')(compute_grpo_outcome_advantage)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cfg = _load("actor_rollout_ref.model.external_lib=my_recipe_h42", "algorithm.adv_estimator=my_recipe_h42_adv")
        assert cfg.algorithm.adv_estimator == "my_recipe_h42_adv"
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop("my_recipe_h42_adv", None)
        sys.modules.pop("my_recipe_h42", None)


def test_an_external_lib_that_does_not_import_is_one_line():
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.external_lib: expected an importable module, "
                                          r"found 'no_such_recipe_h42' \(ModuleNotFoundError: "):
        _load("actor_rollout_ref.model.external_lib=no_such_recipe_h42")
