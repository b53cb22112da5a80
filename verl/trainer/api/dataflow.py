"""RL as a dataflow of named nodes over the PPO trainer `verl train` runs (HybridFlow's single controller, from Python).

    flow = DataFlow()
    flow.add_node("rollout", "rollout", output_keys=["prompts", "responses"])        # the configured engine
    flow.add_node("reward", my_reward, input_keys=["responses"], output_keys=["reward"])
    trainer = flow.build_trainer(config=TrainerConfig(model=path, tokenizer=tok, num_epochs=1, batch_size=4,
                                                      learning_rate=1e-3))
    trainer.train(prompts=["1+2=", ...])

Or as document 000 writes it, with a rollout function of the user's and any key names:

    @register
    def rollout(prompts):            # generates however it likes; returns one text per prompt
        ...
    dataflow.add_node("rollout", rollout, input_keys=["prompts"], output_keys=["responses"])
    dataflow.add_node("reward", reward, input_keys=["responses"], output_keys=["scores"])
    dataflow.add_node("actor", HFActor.from_pretrained(path))       # the model trained (or TrainerConfig(model=))

The rollout node is the trainer's own generation (weights resharded into the rollout engine, log-probs recomputed by the
actor), or a user function reading only ``prompts`` added first: its texts are tokenized with the actor's tokenizer and
the actor computes their log-probs (:mod:`verl.trainer.api.user_rollout`). The nodes after it run where the reward
manager runs (:class:`DataFlowReward` replaces the trainer's ``reward_fn``): each receives the values of its
``input_keys`` for the whole batch as Python values (lists, or tensors for token ids and masks) and returns its
``output_keys`` (a dict, a tuple in that order, or the one value; no ``output_keys``: one value named after the node).
The reward is found by its role: the output no later node reads (``reward`` when several are unread), one number per
response; it becomes the score on each response's last token, from which the configured estimator (GRPO by default,
PPO with a critic) computes advantages. Keys are checked before training (every input key made by an earlier node,
one reward); lengths and types at the first step. ``HFActor`` / ``HFCritic`` nodes name the models trained.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from verl.errors import InputError

ROLLOUT = "rollout"
REWARD_KEY = "reward"
# What the rollout node hands the nodes after it, per response (B = prompts x rollout n):
ROLLOUT_KEYS = {
    "prompts": "the prompt text (list of B str)",
    "responses": "the response text, special tokens skipped (list of B str)",
    "prompt_ids": "the prompt token ids, left-padded (tensor [B, P])",
    "response_ids": "the response token ids, right-padded (tensor [B, R])",
    "input_ids": "prompt + response token ids (tensor [B, P + R])",
    "attention_mask": "its mask (tensor [B, P + R])",
    "response_mask": "the response tokens' mask (tensor [B, R])",
    "log_probs": "the rollout's log-probs of the response tokens (tensor [B, R])",
    "ground_truth": "the dataset's reward_model.ground_truth (list of B)",
    "data_source": "the dataset's data_source (list of B str)",
}
DEBUG_MODES = ("full", "light", "none")
_SEEN = "_user_rollout_seen"  # what a user rollout function was given and returned (its debug output)
NODE_MARK = "_verl_dataflow_node"


def register(fn: Callable | None = None, **kwargs: Any) -> Any:
    """``@register`` on a plain function marks it a dataflow node (``@register(input_keys=[...],
    output_keys=[...])`` records its keys, so ``DataFlow().add_node(fn)`` needs no more); with a dispatch mode
    (``@register(dispatch_mode=Dispatch.ONE_TO_ALL)``, or positionally) it is the worker-method decorator of
    :func:`verl.single_controller.decorator.register`."""
    node_keys = {"input_keys", "output_keys", "name"}
    if fn is not None and callable(fn) and not kwargs and not _is_dispatch_mode(fn):
        setattr(fn, NODE_MARK, {"name": fn.__name__, "input_keys": None, "output_keys": None})
        return fn
    if fn is None and kwargs and set(kwargs) <= node_keys:
        def mark(f: Callable) -> Callable:
            setattr(f, NODE_MARK, {"name": kwargs.get("name", f.__name__), "input_keys": kwargs.get("input_keys"),
                                   "output_keys": kwargs.get("output_keys")})
            return f
        return mark
    from verl.single_controller.decorator import register as worker_register

    return worker_register(fn, **kwargs) if fn is not None else worker_register(**kwargs)


def _is_dispatch_mode(obj: Any) -> bool:
    from verl.single_controller.decorator import Dispatch, DispatchSpec

    return isinstance(obj, (Dispatch, DispatchSpec))


@dataclasses.dataclass
class Node:
    name: str
    fn: Any  # ROLLOUT, a callable, a torch.nn.Module, or an HFActor / HFCritic (a model the trainer trains)
    input_keys: tuple[str, ...]
    output_keys: tuple[str, ...]
    user_rollout: bool = False  # a user function generating the responses (set by DataFlow.validate)

    @property
    def is_rollout(self) -> bool:
        return (isinstance(self.fn, str) and self.fn == ROLLOUT) or self.user_rollout

    @property
    def is_model(self) -> bool:
        from verl.models.hf import HFModel

        return isinstance(self.fn, HFModel)


class DataFlow:
    """An ordered graph of nodes: the rollout (first; added by default), then user functions or modules."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.debug_mode = "none"
        self.reward_key = REWARD_KEY  # the reward node's output (DataFlow.validate finds it by its role)

    def add_node(self, name: Any, fn: Any = None, input_keys: Sequence[str] | None = None,
                 output_keys: Sequence[str] | None = None) -> DataFlow:
        """Add node ``name`` running ``fn``: ``"rollout"`` (the configured rollout engine), a function (or an
        ``@register``-ed one, whose recorded keys are the defaults), or a ``torch.nn.Module`` (its forward, called
        with the input keys as keyword arguments: ``input_ids=...``), or an ``HFActor`` /
        ``HFCritic`` (the model the trainer trains, no keys). ``add_node(fn)``: an ``@register``-ed function under its
        own name. Without ``output_keys`` a function's one value is named after the node. Returns the dataflow (calls
        chain)."""
        from verl.models.hf import HFModel

        if fn is None and callable(name):
            name, fn = getattr(name, NODE_MARK, {}).get("name") or name.__name__, name
        if not isinstance(name, str) or not name:
            raise InputError(f"dataflow: expected a node name (a non-empty str), found {name!r}")
        if any(node.name == name for node in self.nodes):
            raise InputError(f"dataflow node {name!r}: expected a new name, found one already added")
        mark = getattr(fn, NODE_MARK, {})
        input_keys = tuple(input_keys if input_keys is not None else mark.get("input_keys") or ())
        output_keys = output_keys if output_keys is not None else mark.get("output_keys")
        if isinstance(fn, str):
            if fn != ROLLOUT:
                raise InputError(f"dataflow node {name!r}: expected fn 'rollout', a function or a torch.nn.Module, "
                                 f"found the string {fn!r}")
            if self.nodes:
                raise InputError(f"dataflow node {name!r}: expected the rollout node first, found it after "
                                 f"{[n.name for n in self.nodes]}")
            output_keys = tuple(output_keys or ROLLOUT_KEYS)
            unknown = [k for k in output_keys if k not in ROLLOUT_KEYS]
            if unknown:
                raise InputError(f"dataflow node {name!r}: output key {unknown[0]!r}: expected one of the rollout's "
                                 f"keys {sorted(ROLLOUT_KEYS)}, found an unknown key")
        elif isinstance(fn, HFModel):
            if input_keys or output_keys:
                raise InputError(f"dataflow node {name!r}: an {type(fn).__name__} (the model trained) expected no "
                                 f"input_keys or output_keys, found {list(input_keys)} / {list(output_keys or ())}")
            if any(node.is_model and type(node.fn) is type(fn) for node in self.nodes):
                raise InputError(f"dataflow node {name!r}: expected one {type(fn).__name__}, found a second")
            output_keys = ()
        elif not callable(fn):
            raise InputError(f"dataflow node {name!r}: expected fn 'rollout', a function, a torch.nn.Module or an "
                             f"HFActor / HFCritic, found {type(fn).__name__}")
        elif not output_keys:
            output_keys = (name,)
        self.nodes.append(Node(name, fn, input_keys, tuple(output_keys)))
        return self

    def enable_debug(self, mode: str = "full") -> DataFlow:
        """Print each node's inputs and outputs every step (rank 0): ``full`` as Python values, ``light`` their
        types and lengths and first element, ``none`` nothing."""
        if mode not in DEBUG_MODES:
            raise InputError(f"enable_debug(mode): expected one of {list(DEBUG_MODES)}, found {mode!r}")
        self.debug_mode = mode
        return self

    @property
    def flow_nodes(self) -> list[Node]:
        """The nodes that run each step (not the HFActor / HFCritic naming the models)."""
        return [node for node in self.nodes if not node.is_model]

    def model(self, role: str) -> Any:
        """The ``HFActor`` (``role`` "actor") or ``HFCritic`` ("critic") added as a node, or None."""
        return next((node.fn for node in self.nodes if node.is_model and node.fn.role == role), None)

    @property
    def user_rollout(self) -> Node | None:
        return next((node for node in self.nodes if node.user_rollout), None)

    def validate(self) -> None:
        """Each node's role and keys: the rollout first (the engine's, added when none was; or a user function
        reading only ``prompts`` and making one value, the responses' texts), every input key made by an earlier
        node, one reward (InputError naming the node and the key otherwise)."""
        flow = self.flow_nodes
        first = flow[0] if flow else None
        if first is not None and not first.is_rollout and callable(first.fn) and not _is_module(first.fn) \
                and set(first.input_keys) <= {"prompts"} and len(first.output_keys) == 1:
            first.user_rollout = True
        if first is None or not first.is_rollout:
            self.nodes.insert(0, Node(ROLLOUT, ROLLOUT, (), tuple(ROLLOUT_KEYS)))
        available: dict[str, str] = {"prompts": "the dataset"} if first is not None and first.user_rollout else {}
        read: set[str] = set()
        for node in self.flow_nodes:
            for key in node.input_keys:
                if key not in available:
                    raise InputError(f"dataflow node {node.name!r}: input key {key!r}: expected it from an earlier "
                                     f"node, found none (available: {sorted(available)})")
                read.add(key)
            if node.user_rollout:  # its texts, tokenized: every rollout key but the rollout's log-probs
                available.update({k: node.name for k in ROLLOUT_KEYS if k != "log_probs"})
            for key in node.output_keys:
                available[key] = node.name
        self.reward_key = self._reward_key(available, read)

    def _reward_key(self, available: dict[str, str], read: set[str]) -> str:
        """The reward by its role: the one output of a node after the rollout that no later node reads; ``reward``
        among several such outputs."""
        unread = [k for node in self.flow_nodes if not node.is_rollout for k in node.output_keys if k not in read]
        if len(unread) == 1:
            return unread[0]
        if REWARD_KEY in unread:
            return REWARD_KEY
        if not unread:
            raise InputError(f"dataflow: expected a node after the rollout whose output (one number per response) is "
                             f"the reward, found none (outputs: {sorted(available)})")
        raise InputError(f"dataflow: expected one reward (a node output no later node reads), found "
                         f"{len(unread)}: {', '.join(f'{k!r} of node {available[k]!r}' for k in unread)}; name the "
                         f"reward's output 'reward' or read the others in a later node")

    def build_trainer(self, config: Any = None) -> DataFlowTrainer:
        """The trainer for this dataflow (checked now); ``config``: a :class:`TrainerConfig`."""
        self.validate()
        return DataFlowTrainer(self, self._with_models(config if config is not None else TrainerConfig()))

    def _with_models(self, config: TrainerConfig) -> TrainerConfig:
        """``config`` with the HFActor / HFCritic nodes' models (their paths, tokenizer, LoRA and strategy)."""
        actor, critic = self.model("actor"), self.model("critic")
        if actor is None and critic is None:
            return config
        config = dataclasses.replace(config, overrides=dict(config.overrides))
        if actor is not None:
            apply_actor(config, actor)
        if critic is not None:
            apply_critic(config, critic)
            config.algorithm = "gae"
        return config

    # ------------------------------------------------------------------ one step's user nodes
    def run(self, values: dict[str, Any], batch_size: int, rank: int = 0) -> dict[str, Any]:
        """The nodes after the rollout over ``values`` (the rollout's outputs); every key's values."""
        for node in self.flow_nodes:
            if node.user_rollout:  # it ran before the step (UserRolloutGroup); its texts as trained (tokenized)
                values[node.output_keys[0]] = values["responses"]
                seen = values.get(_SEEN, (values["prompts"], values["responses"]))
                self._debug(node, {"prompts": seen[0]}, {node.output_keys[0]: seen[1]}, rank)
                continue
            if node.is_rollout:
                values = {k: v for k, v in values.items() if k in node.output_keys}
                self._debug(node, {}, values, rank)
                continue
            inputs = {k: values[k] for k in node.input_keys}
            out = _call_node(node, inputs)
            for key, value in out.items():
                values[key] = _check_output(node, key, value, batch_size, key == self.reward_key)
            self._debug(node, inputs, {k: values[k] for k in out}, rank)
        return values

    def _debug(self, node: Node, inputs: dict[str, Any], outputs: dict[str, Any], rank: int) -> None:
        if self.debug_mode == "none" or rank != 0:
            return
        show = _as_python if self.debug_mode == "full" else _summary
        print(f"[dataflow] {node.name}: inputs {({k: show(v) for k, v in inputs.items()})} -> outputs "
              f"{({k: show(v) for k, v in outputs.items()})}", flush=True)


def _is_module(fn: Any) -> bool:
    """A torch.nn.Module, or its bound method (``reward_model.forward``)."""
    import torch

    return isinstance(fn, torch.nn.Module) or isinstance(getattr(fn, "__self__", None), torch.nn.Module)


def _call_node(node: Node, inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    if _is_module(node.fn):
        with torch.no_grad():
            result = node.fn(**inputs)
        if hasattr(result, "logits") and not isinstance(result, torch.Tensor):
            result = result.logits
    else:
        result = node.fn(**inputs)
    keys = node.output_keys
    if isinstance(result, dict):
        missing = [k for k in keys if k not in result]
        if missing:
            raise InputError(f"dataflow node {node.name!r}: output key {missing[0]!r}: expected it in the node's "
                             f"returned dict, found only {sorted(result)}")
        return {k: result[k] for k in keys}
    if len(keys) == 1:
        return {keys[0]: result}
    if not isinstance(result, tuple) or len(result) != len(keys):
        raise InputError(f"dataflow node {node.name!r}: output key {keys[0]!r}: expected a dict or a tuple of "
                         f"{len(keys)} values ({list(keys)}), found {type(result).__name__}")
    return dict(zip(keys, result, strict=True))


def _check_output(node: Node, key: str, value: Any, batch_size: int, reward: bool = False) -> Any:
    """A node's output for ``key``: one value per response; the reward as numbers (a float tensor [B])."""
    import numpy as np
    import torch

    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 2 and value.shape[-1] == 1:
            value = value[:, 0]
        length = value.shape[0] if value.ndim else None
    elif isinstance(value, (list, tuple)):
        length = len(value)
    else:
        raise InputError(f"dataflow node {node.name!r}: output key {key!r}: expected a list or a tensor of "
                         f"{batch_size} values, found {type(value).__name__}")
    if length != batch_size:
        raise InputError(f"dataflow node {node.name!r}: output key {key!r}: expected {batch_size} values (one per "
                         f"response), found {length}")
    if reward:
        try:
            value = torch.as_tensor(value if not isinstance(value, torch.Tensor) else value.detach(),
                                    dtype=torch.float32).reshape(batch_size)
        except (TypeError, ValueError, RuntimeError):
            raise InputError(f"dataflow node {node.name!r}: output key {key!r}: expected numbers, found "
                             f"{type(value[0]).__name__} values") from None
    return value


def _as_python(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value) if isinstance(value, tuple) else value


def _summary(value: Any) -> str:
    first = _as_python(value)[0] if len(value) else None
    shape = tuple(value.shape) if hasattr(value, "shape") else len(value)
    return f"{type(value).__name__}{shape} first={first!r}"


class DataFlowReward:
    """The dataflow's nodes where the trainer's reward manager runs: ``(batch) -> token_level_scores [B, R]`` (the
    ``reward`` on each response's last token), with ``return_dict`` as verl's reward managers."""

    def __init__(self, dataflow: DataFlow, tokenizer: Any, rank: int = 0):
        self.dataflow, self.tokenizer, self.rank = dataflow, tokenizer, rank

    def rollout_values(self, data: Any) -> dict[str, Any]:
        prompts, responses = data.batch["prompts"], data.batch["responses"]
        width = prompts.shape[-1]
        mask = data.batch["attention_mask"]
        response_mask = mask[:, width:]
        lengths = response_mask.sum(-1).tolist()
        decode = self.tokenizer.decode
        values = {
            "prompts": [decode(row[mask[i, :width].bool()].tolist(), skip_special_tokens=True)
                        for i, row in enumerate(prompts)],
            "responses": [decode(row[:int(n)].tolist(), skip_special_tokens=True)
                          for row, n in zip(responses, lengths, strict=True)],
            "prompt_ids": prompts, "response_ids": responses, "input_ids": data.batch["input_ids"],
            "attention_mask": mask, "response_mask": response_mask,
        }
        if "rollout_log_probs" in data.batch.keys():
            values["log_probs"] = data.batch["rollout_log_probs"]
        rm = data.non_tensor_batch.get("reward_model")
        values["ground_truth"] = [r.get("ground_truth") if isinstance(r, dict) else None for r in rm] \
            if rm is not None else [None] * len(data)
        from verl.trainer.api.user_rollout import PROMPTS_SEEN, TEXTS_RETURNED

        if PROMPTS_SEEN in data.non_tensor_batch:  # a user rollout's own inputs and outputs, for the debug output
            values[_SEEN] = (list(data.non_tensor_batch[PROMPTS_SEEN]), list(data.non_tensor_batch[TEXTS_RETURNED]))
        source = data.non_tensor_batch.get("data_source")
        values["data_source"] = list(source) if source is not None else [None] * len(data)
        return values

    def __call__(self, data: Any, return_dict: bool = False) -> Any:
        import torch

        values = self.dataflow.run(self.rollout_values(data), len(data), self.rank)
        reward = values[self.dataflow.reward_key]
        lengths = data.batch["attention_mask"][:, data.batch["prompts"].shape[-1]:].sum(-1)
        scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        rows = torch.nonzero(lengths > 0).flatten()  # an empty response has no token to carry its reward
        scores[rows, lengths[rows] - 1] = reward[rows]
        if return_dict:
            return {"reward_tensor": scores, "reward_extra_info": {self.dataflow.reward_key: reward.tolist()}}
        return scores


@dataclasses.dataclass
class TrainerConfig:
    """The dataflow trainer's few settings, mapped onto verl's keys (``overrides``: any further verl keys, dotted,
    e.g. ``{"algorithm.adv_estimator": "rloo"}``). ``algorithm``: verl's ``adv_estimator`` (grpo, rloo, remax,
    reinforce_plus_plus, gae: PPO with a critic)."""

    model: str | None = None
    tokenizer: str | None = None
    num_epochs: int = 1
    batch_size: int = 4
    learning_rate: float = 1e-6
    algorithm: str = "grpo"
    rollout_n: int = 4
    max_prompt_length: int = 64
    max_response_length: int = 32
    total_steps: int | None = None
    save_freq: int = 0
    output_dir: str = "outputs/dataflow"
    seed: int = 1
    critic: str | None = None          # the critic's model (algorithm gae); None: the actor's model
    reward_model: str | None = None    # a reward model's directory (reward_model.enable); None: the reward nodes
    layout: str = "auto"               # "auto": chosen from the model, ranks and memory unless a layout key is named
                                       # (verl.models.layout_choice); "default": the packaged defaults
    device_memory_gib: float | None = None  # the memory per device the auto layout plans for (None: this machine's)
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def verl_config(self, world_size: int) -> dict[str, Any]:
        if not self.model or not self.tokenizer:
            raise InputError("TrainerConfig: expected model= and tokenizer= (local paths), found "
                             f"model={self.model!r}, tokenizer={self.tokenizer!r}")
        rows = self.batch_size * self.rollout_n
        micro = max(1, rows // world_size)
        config = {
            "data": {"tokenizer": self.tokenizer, "max_prompt_length": self.max_prompt_length,
                     "max_response_length": self.max_response_length, "train_batch_size": self.batch_size,
                     "seed": self.seed},
            "actor_rollout_ref": {
                "model": {"path": self.model},
                "actor": {"ppo_mini_batch_size": self.batch_size, "ppo_micro_batch_size_per_gpu": micro,
                          "optim": {"lr": self.learning_rate}},
                "ref": {"log_prob_micro_batch_size_per_gpu": micro},
                "rollout": {"name": "native", "n": self.rollout_n, "log_prob_micro_batch_size_per_gpu": micro}},
            "algorithm": {"adv_estimator": self.algorithm},
            "trainer": {"nnodes": 1, "n_gpus_per_node": world_size, "total_epochs": self.num_epochs,
                        "total_training_steps": self.total_steps, "output_dir": os.path.abspath(self.output_dir),
                        "save_freq": self.save_freq, "test_freq": 0, "val_before_train": False,
                        "logger": ["console"], "seed": self.seed},
        }
        if self.algorithm == "gae":
            config["critic"] = {"model": {"path": self.critic or self.model}, "ppo_micro_batch_size_per_gpu": micro,
                                "ppo_mini_batch_size": self.batch_size}
        if self.reward_model:
            config["reward_model"] = {"enable": True, "model": {"path": self.reward_model},
                                      "micro_batch_size_per_gpu": micro}
        for dotted, value in self.overrides.items():
            node = config
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return config


class DataFlowTrainer:
    """:meth:`train` runs the dataflow's RL loop: the PPO trainer of `verl train` with the dataflow as its reward
    (``dataflow`` None: the configured reward, a reward model or the dataset's scorer). ``overrides``: ``key=value``
    strings in `verl train`'s grammar, applied last."""

    def __init__(self, dataflow: DataFlow | None, config: TrainerConfig, overrides: Sequence[str] = ()):
        self.dataflow, self.config, self.overrides = dataflow, config, list(overrides)
        self.trainer: Any = None

    def train(self, prompts: Sequence[Any] | None = None, dataset: Any = None,
              resume_from: str | None = None) -> Any:
        """Train on ``prompts`` (str, or dicts with ``prompt`` and ``ground_truth``) or ``dataset`` (a parquet path
        in verl's format, an RLHFDataset, or a :class:`verl.data.DataLoader` over one: its batch size, shuffle and
        seed); ``resume_from``: a checkpoint (a step's directory, or the checkpoints directory: its latest).
        Returns every step's metrics (verl's names) in order: a :class:`verl.metrics.History`, on every rank."""
        import torch.distributed as dist

        from verl.trainer.prepare import ensure_distributed, load_tokenizer, resolve_config

        if self.config.layout not in LAYOUTS:
            raise InputError(f"TrainerConfig.layout: expected one of {list(LAYOUTS)}, found {self.config.layout!r}")
        if (prompts is None) == (dataset is None) and resume_from is None:
            raise InputError("train: expected one of prompts= or dataset=, found "
                             + ("both" if prompts is not None else "neither"))
        from verl.data.loader import DataLoader

        world = dist.get_world_size() if dist.is_initialized() else _launcher_world_size()
        loader = dataset if isinstance(dataset, DataLoader) else None
        if loader is not None:  # the loader's batches: its size (the mini-batch too), order and seed
            dataset = loader.dataset
            tree = dataclasses.replace(self.config, batch_size=loader.batch_size, seed=loader.seed).verl_config(world)
            tree["data"]["shuffle"] = loader.shuffle
        elif prompts is not None and 0 < len(prompts) < self.config.batch_size:
            # Fewer prompts than a batch (000: batch_size=4, two prompts): one batch of them all per epoch.
            if is_driver():
                print(f"[dataflow] train(prompts): {len(prompts)} prompts, fewer than batch_size="
                      f"{self.config.batch_size}: one batch of {len(prompts)} per epoch", flush=True)
            tree = dataclasses.replace(self.config, batch_size=len(prompts)).verl_config(world)
        else:
            tree = self.config.verl_config(world)
        out_dir = tree["trainer"]["output_dir"]
        train_dataset = None
        if prompts is not None:
            tree["data"]["train_files"] = _write_prompts(prompts, os.path.join(out_dir, "dataflow_data"))
        elif isinstance(dataset, (str, os.PathLike)):
            tree["data"]["train_files"] = os.fspath(dataset)
        elif dataset is not None:
            if not hasattr(dataset, "data_files"):
                raise InputError(f"train(dataset): expected a parquet path, an RLHFDataset or a verl.data.DataLoader, "
                                 f"found {type(dataset).__name__}")
            train_dataset = dataset
            tree["data"]["train_files"] = dataset.data_files[0]
        else:  # resuming a run whose prompts are in its output directory
            tree["data"]["train_files"] = os.path.join(out_dir, "dataflow_data", "train.parquet")
        if resume_from is not None:
            tree["trainer"]["resume_mode"] = "resume_path"
            tree["trainer"]["resume_from_path"] = _resume_dir(resume_from)
        if self.config.layout == "auto":
            auto_layout(tree, self.overrides, world, self.config.device_memory_gib)
        config = resolve_config(tree, self.overrides)
        ensure_distributed(config)
        from verl.trainer.v1 import trainer_class

        self.trainer = trainer = trainer_class(config)(config, load_tokenizer(config), train_dataset=train_dataset)
        if self.dataflow is not None:
            trainer.reward_fn = DataFlowReward(self.dataflow, trainer.tokenizer, trainer.rank)
            if self.dataflow.user_rollout is not None:
                _use_user_rollout(trainer, self.dataflow.user_rollout)
        try:
            trainer.fit()
        finally:
            trainer.close()
        dist.barrier()  # rank 0's metrics file is complete
        from verl.metrics import _record, load

        return _record(load(config.trainer.output_dir))


LAYOUTS = ("auto", "default")


def auto_layout(tree: dict[str, Any], overrides: Sequence[str], world: int,
                device_memory_gib: float | None = None) -> Any:
    """The parallel layout chosen for ``tree`` (verl's keys) when neither it nor ``overrides`` (``key=value``)
    names one (:mod:`verl.models.layout_choice`): written into ``tree``, printed in one block by rank 0; returns
    the :class:`~verl.models.layout_choice.LayoutChoice` (None when a layout was named)."""
    from verl.launcher.env import discover
    from verl.models.config import ModelConfig
    from verl.models.layout_choice import GiB, choose_layout, flatten, names_layout

    keys = flatten(tree)
    keys.update({item.split("=", 1)[0].lstrip("+~"): None for item in overrides})
    if names_layout(keys):
        return None
    dtype = keys.get("actor_rollout_ref.actor.megatron.dtype") or keys.get(
        "actor_rollout_ref.actor.fsdp_config.model_dtype") or "float32"
    dtype_bytes = 2 if str(dtype) in ("bfloat16", "bf16", "float16", "fp16") else 4
    memory = None if device_memory_gib is None else int(float(device_memory_gib) * GiB)
    choice = choose_layout(ModelConfig.from_pretrained(tree["actor_rollout_ref"]["model"]["path"]), world,
                           ranks_per_node=discover().local_world_size, device_memory=memory,
                           accelerator=None if memory is None else _has_accelerator(), dtype_bytes=dtype_bytes)
    for dotted, value in choice.overrides.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    if is_driver():
        print(choice.describe(), flush=True)
    return choice


def is_driver() -> bool:
    """Whether this process is the rank that drives output (rank 0 of the launch; True outside a launcher)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank() == 0
    from verl.launcher.env import launcher_rank

    return launcher_rank() == 0


def _has_accelerator() -> bool:
    from verl.utils.device import is_cuda_available

    return is_cuda_available()


def _launcher_world_size() -> int:
    from verl.launcher.env import discover

    return discover().world_size


def _write_prompts(prompts: Sequence[Any], out_dir: str) -> str:
    """``prompts`` as verl's parquet rows (rank 0 writes; every rank reads the same file)."""
    import torch.distributed as dist

    path = os.path.join(out_dir, "train.parquet")
    rows = []
    for i, item in enumerate(prompts):
        text, truth = (item, None) if isinstance(item, str) else (item.get("prompt"), item.get("ground_truth"))
        if not isinstance(text, str):
            raise InputError(f"train(prompts): prompt {i}: expected a str or a dict with a 'prompt' str, found "
                             f"{type(item).__name__}")
        rows.append({"data_source": "dataflow", "prompt": [{"role": "user", "content": text}],
                     "reward_model": {"style": "dataflow", "ground_truth": "" if truth is None else str(truth)},
                     "extra_info": {"index": i}})
    if not dist.is_initialized() or dist.get_rank() == 0:
        import pyarrow as pa
        import pyarrow.parquet as pq

        os.makedirs(out_dir, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), path + ".tmp")
        os.replace(path + ".tmp", path)
    if dist.is_initialized():
        dist.barrier()
    return path


def _resume_dir(path: str) -> str:
    from verl.utils.checkpoint import LATEST_FILE, step_dir

    latest = os.path.join(path, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as fh:
            return step_dir(path, int(fh.read().strip()))
    return os.path.abspath(path)


def apply_actor(config: TrainerConfig, actor: Any) -> None:
    """An ``HFActor``'s model in ``config``: its path and tokenizer (unless the config names them), LoRA keys and
    strategy."""
    from verl.engine.strategies import engine_entry, peft_strategy

    config.model = config.model or actor.path
    config.tokenizer = config.tokenizer or actor.tokenizer_path
    for dotted, value in actor.model_keys("actor_rollout_ref.model").items():
        if dotted != "actor_rollout_ref.model.path":
            config.overrides.setdefault(dotted, value)
    strategy = actor.strategy
    if actor.lora is not None:  # a PeftModel's adapter
        strategy = peft_strategy(strategy, f"{type(actor).__name__}.from_pretrained(PeftModel)")
    if strategy is not None:
        config.overrides.setdefault("model_engine", engine_entry(strategy).model_engine)


def apply_critic(config: TrainerConfig, critic: Any) -> None:
    """An ``HFCritic``'s model in ``config``: its path and LoRA keys (a PeftModel's adapter trains the critic)."""
    config.critic = critic.path
    for dotted, value in critic.model_keys("critic.model").items():
        if dotted != "critic.model.path":
            config.overrides.setdefault(dotted, value)


def _use_user_rollout(trainer: Any, node: Node) -> None:
    """The trainer's generation from the user's rollout node (:mod:`verl.trainer.api.user_rollout`)."""
    from verl.trainer.api.user_rollout import UserRolloutGroup
    from verl.trainer.ppo.trainer import PPOTrainer

    sections = trainer.sections
    rc = sections.algorithm.rollout_correction
    if rc.bypass_mode or rc.rollout_is is not None or rc.rollout_rs is not None:
        raise InputError(f"dataflow node {node.name!r}: a rollout function returns text, no log-probs: expected "
                         f"algorithm.rollout_correction off (bypass_mode false, rollout_is and rollout_rs null), "
                         f"found bypass_mode={rc.bypass_mode} rollout_is={rc.rollout_is} rollout_rs={rc.rollout_rs}")
    if type(trainer) is not PPOTrainer:
        raise InputError(f"dataflow node {node.name!r}: a rollout function expected the synchronous trainer "
                         f"(trainer.v1.trainer_mode=sync), found {type(trainer).__name__}")

    def generate(texts: list[str]) -> Any:
        if not node.input_keys:  # no keys named: the prompts as its one argument
            return node.fn(texts)
        return _call_node(node, {"prompts": texts})[node.output_keys[0]]

    trainer.actor_rollout_wg = UserRolloutGroup(trainer.actor_rollout_wg, generate, trainer.tokenizer,
                                                sections.actor_rollout_ref.rollout.n,
                                                sections.data.max_response_length, node.name)
