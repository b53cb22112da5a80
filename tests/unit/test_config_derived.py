"""Each fact a PPO config implies is defined once (verl.trainer.config.derived, verl.engine.strategies,
verl.utils.torch_dtypes) and every reader agrees with it: the strategy names, the backend, the actor's DP
size, the reshard's bucket bytes, whether a critic and a reference run, the dtype names."""

import os
import re
import subprocess
import sys

import pytest
from helpers.tiny_models import write_arithmetic_data

from verl.engine import registry, strategies
from verl.trainer.config import derived
from verl.trainer.config.ppo import FSDP_ROLES, RULES, load_config
from verl.utils import torch_dtypes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "configs", "grpo_arith_tiny.yaml")
PPO = os.path.join(REPO, "configs", "ppo_arith_tiny.yaml")


def test_the_strategy_names_are_one_table_the_registry_and_the_config_read():
    assert registry.STRATEGIES is strategies.STRATEGIES and registry.engine_name is strategies.engine_name
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model"):
        assert RULES[f"{role}.strategy"].choices is strategies.STRATEGY_NAMES  # read when checked: the live table
        assert tuple(strategies.STRATEGY_NAMES) == tuple(strategies.STRATEGIES)
    assert strategies.ENGINE_TABLE["fsdp"].strategies == ("fsdp", "fsdp2")
    assert set(strategies.ENGINE_TABLE) == set(strategies.STRATEGIES.values())
    assert registry.engine_class("fsdp2").__name__ == "FSDPEngine"  # the class path is the table's


def test_the_strategy_table_and_the_config_check_import_no_engine():
    code = ("import sys, verl.engine.strategies; assert 'torch' not in sys.modules, 'torch'\n"
            "import verl.trainer.config\n"
            "assert not {'verl.engine.registry', 'verl.engine.base'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_dtype_names_are_one_table():
    assert RULES["actor_rollout_ref.actor.megatron.dtype"].choices == torch_dtypes.TRAINING_DTYPES
    assert RULES["actor_rollout_ref.rollout.dtype"].choices == torch_dtypes.TRAINING_DTYPES
    for role in FSDP_ROLES:
        assert RULES[f"{role}.fsdp_config.model_dtype"].choices == torch_dtypes.FSDP_DTYPE_NAMES
    for name in torch_dtypes.FSDP_DTYPE_NAMES:  # either spelling reaches the same torch dtype
        assert torch_dtypes.torch_dtype(name) is torch_dtypes.DTYPES[torch_dtypes.SHORT_NAMES.get(name, name)]
    assert {torch_dtypes.NAME_OF_DTYPE[dtype]: dtype for dtype in torch_dtypes.NAME_OF_DTYPE} == torch_dtypes.DTYPES


@pytest.mark.parametrize("text, owner", [('"fsdp2"', "verl/engine/strategies.py"),
                                         ('"fp32"', "verl/utils/torch_dtypes.py")])
def test_no_module_writes_the_strategy_or_dtype_names_again(text, owner):
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "verl")):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py"):
                with open(path, encoding="utf-8") as fh:
                    if text in fh.read():
                        found.append(os.path.relpath(path, REPO))
    assert found == [owner]


def test_the_workers_read_the_strategy_the_config_settled():
    for name in ("actor_rollout_ref_worker", "critic_worker", "reward_model_worker"):
        with open(os.path.join(REPO, "verl", "workers", f"{name}.py"), encoding="utf-8") as fh:
            assert not re.search(r"\.get\(\"strategy\"", fh.read()), name


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), 80, 8)


@pytest.mark.parametrize("overrides, dp", [
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], 2),
    (["trainer.n_gpus_per_node=4", "model_engine=dp"], 4),
])
def test_the_actor_dp_size_is_one_rule_the_trainer_and_the_config_share(data_args, overrides, dp):
    from verl.trainer.ppo.trainer import balance_layout

    config = load_config(GRPO, [*data_args, *overrides], resolve_only=True)
    assert derived.actor_dp_size(config) == dp
    assert balance_layout(config, derived.world_size(config))[0] == dp


def test_the_reshard_bucket_is_derived_once(data_args):
    megabytes = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=3"
    config = load_config(GRPO, [*data_args, megabytes], resolve_only=True)
    assert config.hybrid_engine.bucket_bytes == derived.reshard_bucket_bytes(config) == 3 * 2**20
    config = load_config(GRPO, [*data_args, "hybrid_engine.bucket_bytes=65536"], resolve_only=True)
    assert config.hybrid_engine.bucket_bytes == derived.reshard_bucket_bytes(config) == 65536


@pytest.mark.parametrize("path, overrides, critic, reference", [
    (PPO, ["algorithm.use_kl_in_reward=false"], True, False),
    (GRPO, [], False, None),
    (GRPO, ["critic.enable=true"], True, None),
    (GRPO, ["actor_rollout_ref.actor.use_kl_loss=true"], False, True),
    (GRPO, ["actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=true"], False, True),
])
def test_which_roles_run_is_derived_once(data_args, path, overrides, critic, reference):
    config = load_config(path, [*data_args, *overrides], resolve_only=True)
    assert derived.use_critic(config) is critic
    if reference is not None:
        assert derived.use_reference(config) is reference
