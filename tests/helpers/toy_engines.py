"""A third training engine and a third rollout engine, each written and registered here only (the module named by
``actor_rollout_ref.model.external_lib``): what a user adding an engine writes, and nothing else. Each leaves a
line in ``VERL_TOY_ENGINE_MARKS``/<kind>.<pid> each time a rank builds it, so a run proves it used them."""

import dataclasses
import os

from verl.engine.fsdp.engine import FSDPEngine
from verl.engine.rollout.native.engine import NativeRollout
from verl.engine.rollout.registry import RolloutEngine, register_rollout, rollout_engine, rollout_names
from verl.engine.strategies import ENGINE_TABLE, EngineEntry, register_engine

TRAINING, ROLLOUT = "toy_fsdp", "toy_native"


def _mark(kind: str) -> None:
    folder = os.environ.get("VERL_TOY_ENGINE_MARKS")
    if folder:
        with open(os.path.join(folder, f"{kind}.{os.getpid()}"), "a") as f:
            f.write(kind + "\n")


class ToyTrainingEngine(FSDPEngine):
    """FSDP2's engine under another name: a backend whose folder would hold this class and its config rules."""

    @classmethod
    def from_spec(cls, spec):
        _mark("training")
        return super().from_spec(spec)


class ToyRollout(NativeRollout):
    """The native engine under another name."""


def _build(rollout, site):
    _mark("rollout")
    engine = ToyRollout(site.model_config, tp_group=site.tp_group, pad_token_id=site.pad_token_id)
    engine.prefix_cache_tokens = site.max_rows * site.max_seq_len
    return engine


# The rows: one per engine (the training engine reuses FSDP2's config rules and YAML block).
if TRAINING not in ENGINE_TABLE:
    register_engine(EngineEntry(TRAINING, ToyTrainingEngine, (TRAINING,), "toy_dp", "ppo_trainer",
                                rules="verl.engine.fsdp.config_rules"))
if ROLLOUT not in rollout_names():
    native = rollout_engine("native")
    register_rollout(RolloutEngine(ROLLOUT, dataclasses.replace(native.capabilities), build=_build,
                                   open_standalone=native.open_standalone))
