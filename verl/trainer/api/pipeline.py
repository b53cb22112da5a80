"""``DataPipeline`` / ``RLTrainer``: an RL job named by its models, over the dataflow trainer (and so over the PPO
trainer `verl train` runs; nothing here trains by itself).

    pipeline = DataPipeline(actors=["model_dir"], reward_models=[exact_match], critics=[],
                            rollout_config={"n": 4, "temperature": 1.0}, train_config={"batch_size": 8},
                            dataset="train.parquet")
    history = RLTrainer(pipeline=pipeline).run()     # a verl.metrics.History

- ``actors``: one actor: a model path (an HF directory or a config.json), an :class:`~verl.models.HFActor`, a
  :class:`~verl.api.HybridActor` (its current weights, written under ``output_dir/hybrid_actor_hf``), or a dict
  with ``model`` and optionally ``tokenizer``, ``learning_rate``, ``strategy`` (``megatron`` or ``fsdp``);
- ``reward_models``: reward functions or ``torch.nn.Module`` s (parameters, of ``forward`` for a module, named after
  the rollout's keys, e.g. ``(responses, ground_truth)`` or ``forward(input_ids)``, one number per response; several
  are summed), or one reward model's directory; none: the dataset's scorer by ``data_source``, as `verl train`;
- ``critics``: none (GRPO by default) or one critic: a model path or an :class:`~verl.models.HFCritic` (PPO with
  GAE);
- ``rollout_config``: the rollout's verl keys (``actor_rollout_ref.rollout.*``: ``n``, ``temperature``, ``name``,
  ``tensor_model_parallel_size`` ...), plus ``max_prompt_length`` / ``max_response_length``, or ``max_length``
  (prompt + response, as transformers' ``generate``: the response gets what the prompt leaves);
- ``train_config``: a :class:`~verl.trainer.api.dataflow.TrainerConfig` or a dict of its fields.

Ranks: every rank of a launch (srun / torchrun / mpirun, found as `verl train` finds them) runs the same script and
executes the controller's code on the same data (SPMD, as `verl train`'s trainer); rank 0 drives what is seen:
it prints, logs ``metrics.jsonl`` and writes the exports (:func:`is_driver`). Outside a launcher the script is a
world of one.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from verl.engine.strategies import STRATEGIES, engine_entry
from verl.errors import InputError
from verl.models.hf import HFActor, HFModel
from verl.trainer.api.dataflow import (
    REWARD_KEY,
    ROLLOUT_KEYS,
    DataFlow,
    DataFlowTrainer,
    TrainerConfig,
    apply_actor,
    apply_critic,
    is_driver,
)
from verl.trainer.api.hybrid_actor import HybridActor

# rollout_config keys that are the data section's (the rest are actor_rollout_ref.rollout.*).
_LENGTHS = ("max_prompt_length", "max_response_length")
_ACTOR_KEYS = ("model", "tokenizer", "learning_rate", "strategy")


def _flatten(prefix: str, tree: Mapping[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _flatten(f"{prefix}{key}.", value, out)
        else:
            out[f"{prefix}{key}"] = value
    return out


def _reward_node(index: int, fn: Callable) -> tuple[str, Callable, tuple[str, ...]]:
    import torch

    try:
        signed = fn.forward if isinstance(fn, torch.nn.Module) else fn
        params = [p for p in inspect.signature(signed).parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        raise InputError(f"reward_models[{index}]: expected a function with named parameters, found "
                         f"{type(fn).__name__}") from None
    keys = tuple(p.name for p in params if p.default is inspect.Parameter.empty)
    unknown = [k for k in keys if k not in ROLLOUT_KEYS]
    if unknown or not keys:
        raise InputError(f"reward_models[{index}] {getattr(fn, '__name__', fn)!r}: parameter "
                         f"{unknown[0] if unknown else '(none)'!r}: expected parameters named after the rollout's "
                         f"keys {sorted(ROLLOUT_KEYS)}, found {list(keys)}")
    return f"reward_{index}", fn, keys


def _sum_rewards(**parts: Any) -> Any:
    import torch

    return sum(torch.as_tensor(v, dtype=torch.float32) for v in parts.values())


@dataclasses.dataclass
class DataPipeline:
    """The models and settings of an RL job (checked when built; see the module's docstring)."""

    actors: Sequence[Any]
    reward_models: Sequence[Any] = ()
    critics: Sequence[Any] = ()
    rollout_config: Mapping[str, Any] | None = None
    train_config: Any = None
    dataset: Any = None  # a parquet path, an RLHFDataset or a verl.data.DataLoader; or RLTrainer.run(dataset=)

    def __post_init__(self) -> None:
        self.trainer_config = self._trainer_config()
        self.dataflow = self._dataflow()

    def _trainer_config(self) -> TrainerConfig:
        train = self.train_config
        if train is None:
            config = TrainerConfig()
        elif isinstance(train, TrainerConfig):
            config = dataclasses.replace(train, overrides=dict(train.overrides))
        elif isinstance(train, Mapping):
            fields = {f.name for f in dataclasses.fields(TrainerConfig)}
            unknown = sorted(set(train) - fields)
            if unknown:
                raise InputError(f"train_config: key {unknown[0]!r}: expected one of {sorted(fields)} (further verl "
                                 "keys go in train_config['overrides'], dotted)")
            config = TrainerConfig(**{**train, "overrides": dict(train.get("overrides") or {})})
        else:
            raise InputError(f"train_config: expected a TrainerConfig or a dict, found {type(train).__name__}")
        explicit_algorithm = isinstance(train, TrainerConfig) or (isinstance(train, Mapping) and "algorithm" in train)

        if isinstance(self.actors, (str, Mapping)) or len(self.actors) != 1:
            found = "one (not in a list)" if isinstance(self.actors, (str, Mapping)) else len(self.actors)
            raise InputError(f"actors: expected a list of one actor (the hybrid actor trains and generates), "
                             f"found {found}")
        actor = self.actors[0]
        if isinstance(actor, HybridActor):  # its weights as they are now (after its steps), where the job writes
            out = actor.save_pretrained(os.path.join(os.path.abspath(config.output_dir), "hybrid_actor_hf"))
            actor = HFActor(out, actor.tokenizer_path)
        hf_actor = actor if isinstance(actor, HFModel) else None
        if hf_actor is not None:
            if hf_actor.role != "actor":
                raise InputError(f"actors[0]: expected a model path, an HFActor or a dict, found an "
                                 f"{type(hf_actor).__name__}")
            actor = {"model": hf_actor.path, "tokenizer": hf_actor.tokenizer_path}
        if isinstance(actor, str):
            actor = {"model": actor}
        if not isinstance(actor, Mapping) or not isinstance(actor.get("model"), str):
            raise InputError(f"actors[0]: expected a model path or a dict with 'model', found {actor!r}")
        unknown = sorted(set(actor) - set(_ACTOR_KEYS))
        if unknown:
            raise InputError(f"actors[0]: key {unknown[0]!r}: expected one of {list(_ACTOR_KEYS)}")
        config.model = actor["model"]
        config.tokenizer = actor.get("tokenizer") or config.tokenizer or actor["model"]
        if hf_actor is not None:
            apply_actor(config, hf_actor)
        if "learning_rate" in actor:
            config.learning_rate = float(actor["learning_rate"])
        if "strategy" in actor:
            if actor["strategy"] not in STRATEGIES:
                raise InputError(f"actors[0].strategy: expected one of {', '.join(STRATEGIES)}, "
                                 f"found {actor['strategy']!r}")
            config.overrides["model_engine"] = engine_entry(actor["strategy"]).model_engine

        if len(self.critics) > 1:
            raise InputError(f"critics: expected at most one critic, found {len(self.critics)}")
        if self.critics:
            critic = self.critics[0]
            if isinstance(critic, HFModel):
                apply_critic(config, critic)
                critic = critic.path
            critic = critic.get("model") if isinstance(critic, Mapping) else critic
            if not isinstance(critic, str):
                raise InputError(f"critics[0]: expected a model path or a dict with 'model', found {critic!r}")
            config.critic = critic
            if not explicit_algorithm:
                config.algorithm = "gae"
            elif config.algorithm != "gae":
                raise InputError(f"critics: expected train_config algorithm 'gae' with a critic, found "
                                 f"{config.algorithm!r}")
        elif config.algorithm == "gae":
            config.critic = None  # PPO with the actor's model as critic, as TrainerConfig does

        models = [m for m in self.reward_models if not callable(m)]
        if models:
            if len(models) > 1 or not isinstance(models[0], str) or len(models) != len(self.reward_models):
                raise InputError("reward_models: expected reward functions or one reward model's directory, found "
                                 + ", ".join(type(m).__name__ for m in self.reward_models))
            config.reward_model = models[0]

        rollout = dict(self.rollout_config or {})
        if "max_length" in rollout:  # transformers' total length: the response gets what the prompt leaves
            total = int(rollout.pop("max_length"))
            prompt = int(rollout.get("max_prompt_length", config.max_prompt_length))
            if "max_response_length" in rollout or total <= prompt:
                found = "max_response_length as well" if "max_response_length" in rollout else \
                    f"max_length={total} <= max_prompt_length={prompt}"
                raise InputError(f"rollout_config: expected max_length (prompt + response) above max_prompt_length, "
                                 f"without max_response_length, found {found}")
            rollout["max_response_length"] = total - prompt
        for key in _LENGTHS:
            if key in rollout:
                setattr(config, key, int(rollout.pop(key)))
        if "n" in rollout:
            config.rollout_n = int(rollout.pop("n"))
        for dotted, value in _flatten("actor_rollout_ref.rollout.", rollout, {}).items():
            config.overrides.setdefault(dotted, value)
        return config

    def _dataflow(self) -> DataFlow | None:
        functions = [m for m in self.reward_models if callable(m)]
        if not functions:
            return None
        flow = DataFlow()
        nodes = [_reward_node(i, fn) for i, fn in enumerate(functions)]
        needed = sorted({k for _, _, keys in nodes for k in keys})
        flow.add_node("rollout", "rollout", output_keys=needed)
        for name, fn, keys in nodes:
            flow.add_node(name, fn, input_keys=keys, output_keys=[name])
        flow.add_node("reward", _sum_rewards, input_keys=[n for n, _, _ in nodes], output_keys=[REWARD_KEY])
        flow.validate()
        return flow


class RLTrainer:
    """Runs a :class:`DataPipeline` with the PPO trainer of `verl train` (``.trainer`` after :meth:`run`).
    ``overrides``: ``key=value`` strings as on `verl train`'s command line (e.g. a script's ``sys.argv[1:]``)."""

    def __init__(self, pipeline: DataPipeline, overrides: Sequence[str] = ()):
        if not isinstance(pipeline, DataPipeline):
            raise InputError(f"RLTrainer(pipeline): expected a DataPipeline, found {type(pipeline).__name__}")
        self.pipeline = pipeline
        self._runner = DataFlowTrainer(pipeline.dataflow, pipeline.trainer_config, overrides)
        self.history: Any = None

    @property
    def trainer(self) -> Any:
        return self._runner.trainer

    @property
    def is_driver(self) -> bool:
        return is_driver()

    def run(self, dataset: Any = None, prompts: Sequence[Any] | None = None, resume_from: str | None = None) -> Any:
        """Train (on the pipeline's dataset unless ``dataset`` or ``prompts`` is given); returns the steps' metrics
        as a :class:`verl.metrics.History` on every rank."""
        if dataset is None and prompts is None:
            dataset = self.pipeline.dataset
        if dataset is None and prompts is None and resume_from is None:
            raise InputError("RLTrainer.run: expected a dataset (DataPipeline(dataset=...) or run(dataset=...)) or "
                             "prompts=, found neither")
        self.history = self._runner.train(prompts=prompts, dataset=dataset, resume_from=resume_from)
        return self.history

    @property
    def metrics(self) -> Any:
        """The last run's metrics (:class:`verl.metrics.History`)."""
        if self.history is None:
            raise InputError("RLTrainer.metrics: expected a finished run(), found none yet")
        return self.history
