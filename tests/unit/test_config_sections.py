"""The typed config sections (the roles' in verl.workers.config, the trainer's own in
verl.trainer.config.sections): each covers its YAML section key for key, carries the rules the loader checks,
validates itself with the loader's one-line messages, is read-only; the trainer reads the config through them and
each worker receives its own section (not the root config)."""

import dataclasses
import os

import pytest
from helpers.tiny_models import write_arithmetic_data

from verl.trainer.config import ConfigError, load_config
from verl.trainer.config.ppo import RULES
from verl.trainer.config.sections import PPOSections
from verl.trainer.ppo import trainer as trainer_module
from verl.workers.config import ActorConfig, ActorRolloutRefConfig, CriticConfig, RewardModelConfig
from verl.workers.config.section import Nested

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO = os.path.join(REPO, "configs", "ppo_arith_tiny.yaml")
SECTIONS = [(kind.type, name) for name, kind in PPOSections._kinds().items()]


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), 80, 8)


def _missing_and_extra(section_cls, tree):
    """The section's keys against a YAML section's, level by level (an open mapping is one key)."""
    kinds = section_cls._kinds()
    out = {(name, "not a field") for name in tree if name not in kinds}
    out |= {(name, "not in the YAML") for name in kinds if name not in tree}
    for name, kind in kinds.items():
        if isinstance(kind, Nested) and name in tree:
            out |= {(f"{name}.{inner}", why) for inner, why in _missing_and_extra(kind.type, tree[name])}
    return out


@pytest.mark.parametrize("section_cls, key", SECTIONS)
def test_each_section_declares_exactly_its_yaml_keys_and_the_loader_checks_its_rules(section_cls, key):
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(load_config(None, [], resolve_only=True))
    assert _missing_and_extra(section_cls, defaults[key]) == set()
    assert set(defaults) - set(PPOSections._kinds()) == {"model_engine"}  # the loader's backend selector
    for dotted, rule in section_cls.rules(key).items():
        assert RULES[dotted] is rule


@pytest.mark.parametrize("dotted, value", [
    ("actor_rollout_ref.actor.ppo_epochs", 0),
    ("actor_rollout_ref.rollout.top_p", 1.5),
    ("actor_rollout_ref.actor.megatron.dtype", "float16"),
    ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method", "diagonal"),
    ("critic.cliprange_value", "abc"),
    ("reward_model.hot_swap.at_step", 0),
    ("data.train_batch_size", 0),
    ("algorithm.gamma", 1.5),
    ("trainer.device", "tpu"),
    ("hybrid_engine.bucket_bytes", 1024),
])
def test_a_section_validates_itself_with_the_loaders_one_line_message(data_args, dotted, value):
    """Built outside the loader from a tree holding a value the loader refuses, the sections raise the very
    line the loader raises."""
    from omegaconf import OmegaConf

    with pytest.raises(ConfigError) as from_loader:
        load_config(PPO, [*data_args, f"{dotted}={value}"], resolve_only=True)
    tree = OmegaConf.to_container(load_config(PPO, data_args, resolve_only=True))
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node[part]
    node[leaf] = value
    with pytest.raises(ConfigError) as from_section:
        PPOSections.from_tree(tree, "")
    assert str(from_section.value) == str(from_loader.value)
    assert "\n" not in str(from_section.value) and str(from_section.value).startswith(dotted)


def test_a_section_is_read_only_and_reads_like_verls_dict_config(data_args):
    config = load_config(PPO, data_args, resolve_only=True)
    actor = ActorConfig.from_tree(config.actor_rollout_ref.actor, "actor_rollout_ref.actor")
    with pytest.raises(dataclasses.FrozenInstanceError):
        actor.ppo_epochs = 2
    assert actor["ppo_epochs"] == actor.ppo_epochs == config.actor_rollout_ref.actor.ppo_epochs
    assert actor.megatron.get("tensor_model_parallel_size") == 1 and actor.get("no_such_key") is None
    assert actor.optim.betas == list(config.actor_rollout_ref.actor.optim.betas)
    assert set(actor) == set(config.actor_rollout_ref.actor)


def test_each_worker_receives_its_own_section(data_args, monkeypatch):
    from transformers import AutoTokenizer

    config = load_config(PPO, [*data_args, "reward_model.enable=true"], resolve_only=True)
    built = {}

    class Recorded:
        def __init__(self, cls, *args, name, **kwargs):
            built[name] = (args, kwargs)

    monkeypatch.setattr(trainer_module, "WorkerGroup", Recorded)
    trainer_module.PPOTrainer(config, AutoTokenizer.from_pretrained(config.data.tokenizer))
    (arr, role, *_), arr_kwargs = built["actor_rollout_ref"]
    assert isinstance(arr, ActorRolloutRefConfig) and role == "actor_rollout_ref"
    assert arr.actor.ppo_mini_batch_size == config.actor_rollout_ref.actor.ppo_mini_batch_size
    assert arr_kwargs["bucket_bytes"] == config.hybrid_engine.bucket_bytes
    assert arr_kwargs["seed"] == config.trainer.seed
    (critic, *_), critic_kwargs = built["critic"]
    assert isinstance(critic, CriticConfig) and critic_kwargs["rollout_n"] == config.actor_rollout_ref.rollout.n
    (rm,), rm_kwargs = built["reward_model"]
    assert isinstance(rm, RewardModelConfig) and rm_kwargs["layout_role"] == arr.actor
