"""RL as a dataflow of named nodes over the PPO trainer `verl train` runs (HybridFlow's single controller, from Python).

    flow = DataFlow()
    flow.add_node("rollout", "rollout", output_keys=["prompts", "responses"])        # the configured engine
    flow.add_node("reward", my_reward, input_keys=["responses"], output_keys=["reward"])
    trainer = flow.build_trainer(config=TrainerConfig(model=path, tokenizer=tok, num_epochs=1, batch_size=4,
                                                      learning_rate=1e-3))
    trainer.train(prompts=["1+2=", ...])

The rollout node is the trainer's own generation (weights resharded into the rollout engine, log-probs recomputed by
the actor). The nodes after it run where the reward manager runs (:class:`DataFlowReward` replaces the trainer's
``reward_fn``): each receives the values of its ``input_keys`` for the whole batch as Python values (lists, or
tensors for token ids and masks) and returns its ``output_keys`` (a dict, a tuple in that order, or the one value);
the key ``reward`` (one number per response) becomes the score on each response's last token, from which the
configured estimator (GRPO by default, PPO with a critic) computes advantages. Keys are checked before training
(every input key made by an earlier node, a ``reward`` made by some node); lengths and types at the first step.
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
    fn: Any  # ROLLOUT, a callable, or a torch.nn.Module
    input_keys: tuple[str, ...]
    output_keys: tuple[str, ...]

    @property
    def is_rollout(self) -> bool:
        return isinstance(self.fn, str) and self.fn == ROLLOUT


class DataFlow:
    """An ordered graph of nodes: the rollout (first; added by default), then user functions or modules."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.debug_mode = "none"

    def add_node(self, name: Any, fn: Any = None, input_keys: Sequence[str] | None = None,
                 output_keys: Sequence[str] | None = None) -> DataFlow:
        """Add node ``name`` running ``fn``: ``"rollout"`` (the configured rollout engine), a function (or an
        ``@register``-ed one, whose recorded keys are the defaults), or a ``torch.nn.Module`` (its forward, called
        with the input keys as keyword arguments: ``input_ids=...``). ``add_node(fn)``: an ``@register``-ed
        function under its own name. Returns the dataflow (calls chain)."""
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
        elif not callable(fn):
            raise InputError(f"dataflow node {name!r}: expected fn 'rollout', a function or a torch.nn.Module, found "
                             f"{type(fn).__name__}")
        elif not output_keys:
            raise InputError(f"dataflow node {name!r}: expected output_keys, found none")
        self.nodes.append(Node(name, fn, input_keys, tuple(output_keys)))
        return self

    def enable_debug(self, mode: str = "full") -> DataFlow:
        """Print each node's inputs and outputs every step (rank 0): ``full`` as Python values, ``light`` their
        types and lengths and first element, ``none`` nothing."""
        if mode not in DEBUG_MODES:
            raise InputError(f"enable_debug(mode): expected one of {list(DEBUG_MODES)}, found {mode!r}")
        self.debug_mode = mode
        return self

    def validate(self) -> None:
        """Every node's input keys made by an earlier node and a ``reward`` made by some node (InputError naming the
        node and the key otherwise); a default rollout node first when none was added."""
        if not self.nodes or not self.nodes[0].is_rollout:
            self.nodes.insert(0, Node(ROLLOUT, ROLLOUT, (), tuple(ROLLOUT_KEYS)))
        available: dict[str, str] = {}
        for node in self.nodes:
            for key in node.input_keys:
                if key not in available:
                    raise InputError(f"dataflow node {node.name!r}: input key {key!r}: expected it from an earlier "
                                     f"node, found none (available: {sorted(available)})")
            for key in node.output_keys:
                available[key] = node.name
        if REWARD_KEY not in available:
            raise InputError(f"dataflow: expected a node with output key {REWARD_KEY!r} (one number per response), "
                             f"found none (outputs: {sorted(available)})")

    def build_trainer(self, config: Any = None) -> DataFlowTrainer:
        """The trainer for this dataflow (checked now); ``config``: a :class:`TrainerConfig`."""
        self.validate()
        return DataFlowTrainer(self, config if config is not None else TrainerConfig())

    # ------------------------------------------------------------------ one step's user nodes
    def run(self, values: dict[str, Any], batch_size: int, rank: int = 0) -> dict[str, Any]:
        """The nodes after the rollout over ``values`` (the rollout's outputs); every key's values."""
        for node in self.nodes:
            if node.is_rollout:
                values = {k: v for k, v in values.items() if k in node.output_keys}
                self._debug(node, {}, values, rank)
                continue
            inputs = {k: values[k] for k in node.input_keys}
            out = _call_node(node, inputs)
            for key, value in out.items():
                values[key] = _check_output(node, key, value, batch_size)
            self._debug(node, inputs, {k: values[k] for k in out}, rank)
        return values

    def _debug(self, node: Node, inputs: dict[str, Any], outputs: dict[str, Any], rank: int) -> None:
        if self.debug_mode == "none" or rank != 0:
            return
        show = _as_python if self.debug_mode == "full" else _summary
        print(f"[dataflow] {node.name}: inputs {({k: show(v) for k, v in inputs.items()})} -> outputs "
              f"{({k: show(v) for k, v in outputs.items()})}", flush=True)


def _call_node(node: Node, inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    if isinstance(node.fn, torch.nn.Module):
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


def _check_output(node: Node, key: str, value: Any, batch_size: int) -> Any:
    """A node's output for ``key``: one value per response; ``reward`` as numbers (a float tensor [B])."""
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
    if key == REWARD_KEY:
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
        source = data.non_tensor_batch.get("data_source")
        values["data_source"] = list(source) if source is not None else [None] * len(data)
        return values

    def __call__(self, data: Any, return_dict: bool = False) -> Any:
        import torch

        values = self.dataflow.run(self.rollout_values(data), len(data), self.rank)
        reward = values[REWARD_KEY]
        lengths = data.batch["attention_mask"][:, data.batch["prompts"].shape[-1]:].sum(-1)
        scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        rows = torch.nonzero(lengths > 0).flatten()  # an empty response has no token to carry its reward
        scores[rows, lengths[rows] - 1] = reward[rows]
        if return_dict:
            return {"reward_tensor": scores, "reward_extra_info": {REWARD_KEY: reward.tolist()}}
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

        from verl.trainer.local_trainer import ensure_distributed, load_tokenizer, resolve_config

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
        try:
            trainer.fit()
        finally:
            trainer.close()
        dist.barrier()  # rank 0's metrics file is complete
        import verl.metrics

        return verl.metrics._record(verl.metrics.load(config.trainer.output_dir))


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
    from verl.api.pipeline import is_driver

    if is_driver():
        print(choice.describe(), flush=True)
    return choice


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
