"""The training-engine contract: every verl strategy name maps to one engine, an unknown one is refused with one
line naming the choices, and both engines implement every method of the contract themselves."""

import inspect

import pytest

from verl.engine.base import TrainingEngine
from verl.engine.registry import STRATEGIES, build_engine, engine_class, engine_name
from verl.trainer.config.ppo import RULES

CONFIG_STRATEGIES = RULES["actor_rollout_ref.actor.strategy"].choices  # what the config accepts


def test_every_verl_strategy_maps_to_its_engine():
    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.megatron.engine import MegatronEngine

    assert set(STRATEGIES) == set(CONFIG_STRATEGIES)  # the config accepts exactly what the registry builds
    assert engine_class("megatron") is MegatronEngine
    assert engine_class("fsdp") is FSDPEngine and engine_class("fsdp2") is FSDPEngine
    assert [engine_name(s) for s in ("megatron", "fsdp", "fsdp2")] == ["megatron", "fsdp", "fsdp"]


@pytest.mark.parametrize("lookup", [engine_name, engine_class, lambda s: build_engine(s, None)])
def test_an_unknown_strategy_is_refused_in_one_line_naming_the_choices(lookup):
    with pytest.raises(ValueError) as err:
        lookup("deepspeed")
    message = str(err.value)
    assert "\n" not in message and "'deepspeed'" in message
    assert all(name in message for name in ("megatron", "fsdp", "fsdp2"))


@pytest.mark.parametrize("strategy", ["megatron", "fsdp"])
def test_each_engine_implements_the_whole_contract_itself(strategy):
    cls = engine_class(strategy)
    assert issubclass(cls, TrainingEngine) and not inspect.isabstract(cls)
    for name in TrainingEngine.__abstractmethods__:
        assert name in vars(cls), f"{cls.__name__}.{name}: expected its own implementation, found the contract's"
