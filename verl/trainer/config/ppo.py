"""The trainer config: verl's key names, one schema, validated once at load.

``load_config(path, overrides)`` reads a YAML file (``yaml.safe_load`` with YAML 1.2 floats, so ``1e-6`` is a
float as in verl), merges it over the
defaults below, applies dotted CLI overrides (``algorithm.adv_estimator=grpo``; values parse as
YAML scalars), and validates everything before any rank starts:

- an unknown key is rejected with a did-you-mean;
- a value of the wrong type is rejected (an int is accepted where a float is expected);
- parallel sizes must divide the model (tp | heads, kv heads, ffn; pp | layers) and the world size
  (``trainer.nnodes * trainer.n_gpus_per_node``);
- batch sizes must divide as the PPO loop splits them (train batch -> mini-batches -> DP ranks ->
  micro-batches);
- under a launcher (Slurm, torchrun, mpirun) its world size must match the config's.

Every problem raises one :class:`ConfigError` whose message names the key; ``verl train`` prints it
as one line and exits 2. The result is an OmegaConf ``DictConfig`` (attribute access, like verl).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from collections.abc import Sequence
from typing import Any

import yaml

from verl.hybrid_engine.planner import DEFAULT_BUCKET_BYTES
from verl.trainer.ppo.core_algos import KL_PENALTY_CHOICES, LOSS_AGG_MODES, AdvantageEstimator
from verl.utils import yaml_io
from verl.utils.dataset.rl_dataset import TRUNCATION_MODES


class ConfigError(ValueError):
    """A trainer config that cannot run; the message is one line naming the key."""


@dataclasses.dataclass(frozen=True)
class Field:
    """A leaf of the schema: its default and the Python types a value may have."""

    default: Any
    types: tuple[type, ...]
    nullable: bool = False
    choices: tuple[Any, ...] | None = None
    ge: float | None = None  # numeric range: value >= ge, value > gt, value <= le
    gt: float | None = None
    le: float | None = None

    def range_text(self) -> str:
        bounds = ((">=", self.ge), (">", self.gt), ("<=", self.le))
        return " and ".join(f"{op} {bound:g}" for op, bound in bounds if bound is not None)

    def in_range(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))


def field(default: Any, *types: type, nullable: bool = False, choices: Sequence[Any] | None = None,
          ge: float | None = None, gt: float | None = None, le: float | None = None) -> Field:
    if not types:
        types = (type(default),)
    if float in types and int not in types:
        types = types + (int,)
    return Field(default, tuple(types), nullable or default is None, tuple(choices) if choices else None, ge, gt, le)


ADV_ESTIMATORS = tuple(e.value for e in AdvantageEstimator)
LOGGERS = ("console", "tensorboard", "csv")
ROLLOUT_DTYPES = ("float32", "bfloat16")
# The smallest bucket the planner is allowed: a 4 KiB page (a bucket holds one element per micro-DP
# rank at least; smaller buckets only multiply collective calls).
MIN_BUCKET_BYTES = 4096


def _optim() -> dict[str, Field]:
    return {
        "lr": field(1e-6, float, ge=0),
        "min_lr": field(0.0, float, ge=0),
        "lr_warmup_steps": field(0, int, ge=0),
        "lr_decay_style": field("constant", choices=("constant", "linear", "cosine")),
        "weight_decay": field(0.01, float, ge=0),
        "betas": field([0.9, 0.999], list),
        "clip_grad": field(1.0, float, ge=0),
    }


def _megatron() -> dict[str, Field]:
    return {
        "tensor_model_parallel_size": field(1, int, ge=1),
        "pipeline_model_parallel_size": field(1, int, ge=1),
        "use_distributed_optimizer": field(False, bool),
        "seed": field(42, int),
    }


SCHEMA: dict[str, Any] = {
    "data": {
        "tokenizer": field(None, str),
        "train_files": field(None, str, list),
        "val_files": field(None, str, list),
        "prompt_key": field("prompt", str),
        "reward_fn_key": field("data_source", str),
        "max_prompt_length": field(512, int, ge=1),
        "max_response_length": field(512, int, ge=1),
        "train_batch_size": field(1024, int, ge=1),
        "val_batch_size": field(None, int, ge=1),
        "shuffle": field(True, bool),
        "seed": field(1, int),
        "truncation": field("error", choices=TRUNCATION_MODES),
        "filter_overlong_prompts": field(False, bool),
        "dataloader_num_workers": field(0, int, choices=(0,)),
    },
    "actor_rollout_ref": {
        "hybrid_engine": field(True, bool, choices=(True,)),
        "model": {
            "path": field(None, str),
        },
        "actor": {
            "strategy": field("megatron", choices=("megatron",)),
            "ppo_mini_batch_size": field(256, int, ge=1),
            "ppo_micro_batch_size_per_gpu": field(1, int, ge=1),
            "ppo_epochs": field(1, int, ge=1),
            "shuffle": field(False, bool),
            "clip_ratio": field(0.2, float, gt=0),
            "clip_ratio_low": field(None, float, gt=0),
            "clip_ratio_high": field(None, float, gt=0),
            "clip_ratio_c": field(3.0, float, gt=1),
            "loss_agg_mode": field("token-mean", choices=LOSS_AGG_MODES),
            "entropy_coeff": field(0.0, float, ge=0),
            "use_kl_loss": field(False, bool),
            "kl_loss_coef": field(0.001, float, ge=0),
            "kl_loss_type": field("low_var_kl", choices=KL_PENALTY_CHOICES),
            "optim": _optim(),
            "megatron": _megatron(),
        },
        "ref": {
            "log_prob_micro_batch_size_per_gpu": field(1, int, ge=1),
        },
        "rollout": {
            "name": field("native", choices=("native",)),
            "dtype": field("float32", choices=ROLLOUT_DTYPES),
            "temperature": field(1.0, float, ge=0),
            "top_k": field(-1, int, ge=-1),
            "top_p": field(1.0, float, gt=0, le=1),
            "do_sample": field(True, bool),
            "n": field(1, int, ge=1),
            "tensor_model_parallel_size": field(1, int, ge=1),
            "log_prob_micro_batch_size_per_gpu": field(1, int, ge=1),
            "ignore_eos": field(False, bool),
            "val_kwargs": {
                "do_sample": field(False, bool),
                "temperature": field(0.0, float, ge=0),
                "top_k": field(-1, int, ge=-1),
                "top_p": field(1.0, float, gt=0, le=1),
                "n": field(1, int, ge=1),
            },
        },
    },
    "critic": {
        "strategy": field("megatron", choices=("megatron",)),
        "model": {
            "path": field(None, str),
        },
        "ppo_mini_batch_size": field(256, int, ge=1),
        "ppo_micro_batch_size_per_gpu": field(1, int, ge=1),
        "ppo_epochs": field(1, int, ge=1),
        "shuffle": field(False, bool),
        "cliprange_value": field(0.5, float, gt=0),
        "loss_agg_mode": field("token-mean", choices=LOSS_AGG_MODES),
        "optim": _optim(),
    },
    "reward_model": {
        "enable": field(False, bool),
        "strategy": field("megatron", choices=("megatron",)),
        "model": {
            "path": field(None, str),
        },
        "micro_batch_size_per_gpu": field(1, int, ge=1),
        "reward_manager": field("naive", choices=("naive",)),
        # Replace the reward model between steps (verl-hpc extension, see reward_model_worker.py).
        "hot_swap": {
            "watch": field(False, bool),
            "path": field(None, str),
            "at_step": field(None, int, ge=1),
        },
    },
    "custom_reward_function": {
        "path": field(None, str),
        "name": field("compute_score", str),
    },
    "algorithm": {
        "adv_estimator": field("gae", choices=ADV_ESTIMATORS),
        "gamma": field(1.0, float, ge=0, le=1),
        "lam": field(1.0, float, ge=0, le=1),
        "norm_adv_by_std_in_grpo": field(True, bool),
        "use_kl_in_reward": field(False, bool),
        "kl_penalty": field("kl", choices=KL_PENALTY_CHOICES),
        "kl_ctrl": {
            "type": field("fixed", choices=("fixed", "adaptive")),
            "kl_coef": field(0.001, float, ge=0),
            "horizon": field(10000, int, ge=1),
            "target_kl": field(0.1, float, gt=0),
        },
    },
    "hybrid_engine": {
        "bucket_bytes": field(DEFAULT_BUCKET_BYTES, int, ge=MIN_BUCKET_BYTES),
    },
    "trainer": {
        "project_name": field("verl_hpc", str),
        "experiment_name": field("run", str),
        "logger": field(["console"], list, str),  # verl accepts `logger=console` and a list
        "nnodes": field(1, int, ge=1),
        "n_gpus_per_node": field(1, int, ge=1),
        "total_epochs": field(1, int, ge=1),
        "total_training_steps": field(None, int, ge=1),
        "output_dir": field("outputs/run", str),
        "default_local_dir": field(None, str),
        "save_freq": field(-1, int, ge=-1),
        "test_freq": field(-1, int, ge=-1),
        "val_before_train": field(True, bool),
        "resume_mode": field("auto", str),  # auto | disable | resume_path | a checkpoint directory
        "resume_from_path": field(None, str),
        "debug": field(None, str, choices=("light", "full")),
        "log_val_generations": field(0, int, ge=0),
        "export_hf_every_save": field(False, bool),
        "export_hf_at_end": field(True, bool),
        "seed": field(1234, int),
    },
}


# --------------------------------------------------------------------------- merging and types
def schema_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: schema_defaults(v) if isinstance(v, dict) else copy.deepcopy(v.default) for k, v in schema.items()}


def _all_keys(schema: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in schema.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out.extend(_all_keys(value, prefix + key + "."))
    return out


def _unknown(key: str, schema: dict[str, Any], prefix: str) -> ConfigError:
    dotted = prefix + key
    siblings = [prefix + k for k in schema]
    guess = difflib.get_close_matches(dotted, siblings, n=1) or difflib.get_close_matches(
        dotted, _all_keys(SCHEMA), n=1, cutoff=0.7)
    expected = f"a known key (did you mean '{guess[0]}'?)" if guess else f"one of {sorted(schema)}"
    return ConfigError(f"{dotted}: unknown key: expected {expected}, found '{key}'")


def _type_names(field: Field) -> str:
    names = [t.__name__ for t in field.types if not (t is int and float in field.types)]
    return " or ".join(names + (["null"] if field.nullable else []))


def _check_value(dotted: str, field: Field, value: Any) -> Any:
    if value is None:
        if not field.nullable:
            raise ConfigError(f"{dotted}: expected {_type_names(field)}, found null")
        return None
    if int in field.types and float not in field.types and isinstance(value, float) and value.is_integer():
        value = int(value)  # `trainer.total_training_steps=1e3` (a YAML 1.2 float) is the integer 1000
    ok = isinstance(value, field.types) and not (isinstance(value, bool) and bool not in field.types)
    if not ok:
        raise ConfigError(f"{dotted}: expected {_type_names(field)}, found {type(value).__name__} {value!r}")
    if float in field.types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if field.choices is not None and value not in field.choices:
        raise ConfigError(f"{dotted}: expected one of {list(field.choices)}, found {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value != value:  # NaN passes no range and poisons every step
            raise ConfigError(f"{dotted}: expected a number, found nan")
        if not field.in_range(value):
            raise ConfigError(f"{dotted}: expected a value {field.range_text()}, found {value!r}")
    return value


def merge_into_schema(target: dict[str, Any], source: Any, schema: dict[str, Any], prefix: str = "") -> None:
    if not isinstance(source, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a mapping, found {type(source).__name__}")
    for key, value in source.items():
        if key not in schema:
            raise _unknown(str(key), schema, prefix)
        node = schema[key]
        if isinstance(node, dict):
            merge_into_schema(target[key], value if value is not None else {}, node, prefix + key + ".")
        else:
            target[key] = _check_value(prefix + key, node, value)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. trainer.total_training_steps=3)")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override {item!r}: expected a dotted key before '='")
    try:
        value = yaml_io.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _apply_override(config: dict[str, Any], parts: list[str], value: Any, schema: dict[str, Any]) -> None:
    nested: Any = value
    for part in reversed(parts):
        nested = {part: nested}
    merge_into_schema(config, nested, schema)


# --------------------------------------------------------------------------- semantic checks
def world_size(cfg: dict[str, Any]) -> int:
    return cfg["trainer"]["nnodes"] * cfg["trainer"]["n_gpus_per_node"]


def use_critic(cfg: dict[str, Any]) -> bool:
    """verl: a critic exists exactly when advantages come from GAE."""
    return cfg["algorithm"]["adv_estimator"] == "gae"


def use_reference(cfg: dict[str, Any]) -> bool:
    return cfg["algorithm"]["use_kl_in_reward"] or cfg["actor_rollout_ref"]["actor"]["use_kl_loss"]


def _positive(cfg: dict[str, Any], dotted: str) -> int:
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part]
    if node is None or node < 1:
        raise ConfigError(f"{dotted}: expected a positive integer, found {node!r}")
    return node


def _check_divides(what: str, divisor: int, total_what: str, total: int) -> None:
    if total % divisor:
        raise ConfigError(f"{what}={divisor}: expected a divisor of {total_what}={total}, "
                          f"found remainder {total % divisor}")


def resolve_path(path: str | None, base_dir: str) -> str | None:
    if path is None:
        return None
    path = os.path.expanduser(path)
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    candidate = os.path.join(base_dir, path)
    return os.path.abspath(candidate) if os.path.exists(candidate) else os.path.abspath(path)


def _validate(cfg: dict[str, Any], launcher_world_size: int | None) -> None:
    from verl.models.config import ModelConfig, ModelConfigError
    from verl.models.mcore.model import ModelLayoutError, check_parallel_layout

    data, arr, algo, trainer = cfg["data"], cfg["actor_rollout_ref"], cfg["algorithm"], cfg["trainer"]
    actor, rollout, critic = arr["actor"], arr["rollout"], cfg["critic"]
    for key in ("data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
                "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                "actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.rollout.n",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
                "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.total_epochs",
                "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_epochs",
                "hybrid_engine.bucket_bytes"):
        _positive(cfg, key)
    if trainer["total_training_steps"] is not None:
        _positive(cfg, "trainer.total_training_steps")
    if isinstance(trainer["logger"], str):
        trainer["logger"] = [trainer["logger"]]
    mode = trainer["resume_mode"]
    if mode == "resume_path":
        path = trainer["resume_from_path"]
        if path is None or not os.path.isdir(path):
            raise ConfigError(f"trainer.resume_from_path: expected a checkpoint directory (global_step_<N>) for "
                              f"resume_mode=resume_path, found {'null' if path is None else 'nothing at ' + path}")
    elif mode not in ("auto", "disable") and not os.path.isdir(mode):
        raise ConfigError(f"trainer.resume_mode: expected auto, disable, resume_path or an existing checkpoint "
                          f"directory, found {mode!r}")
    for key in cfg["trainer"]["logger"]:
        if key not in LOGGERS:
            raise ConfigError(f"trainer.logger: expected entries among {list(LOGGERS)}, found {key!r}")
    for key in ("train_files", "tokenizer"):
        if data[key] is None:
            raise ConfigError(f"data.{key}: expected a path, found null")
    for key in ("train_files", "val_files"):
        files = data[key]
        for path in ([files] if isinstance(files, str) else files or []):
            if not os.path.isfile(path):
                raise ConfigError(f"data.{key}: expected an existing parquet file, found no file at {path} "
                                  f"(generate the quickstart data with `verl data arithmetic --out DIR`)")
    if not os.path.isdir(data["tokenizer"]):
        raise ConfigError(f"data.tokenizer: expected a tokenizer directory, found nothing at {data['tokenizer']}")
    if arr["model"]["path"] is None:
        raise ConfigError("actor_rollout_ref.model.path: expected an HF config.json or model directory, found null")
    try:
        model = ModelConfig.from_pretrained(arr["model"]["path"])
    except ModelConfigError as err:
        raise ConfigError(f"actor_rollout_ref.model.path: {err}") from None

    # Parallel layout: Megatron (t, p, d) for actor, reference and critic; rollout t_g.
    world = world_size(cfg)
    tp = actor["megatron"]["tensor_model_parallel_size"]
    pp = actor["megatron"]["pipeline_model_parallel_size"]
    prefix = "actor_rollout_ref.actor.megatron."
    try:
        check_parallel_layout(model, tp, pp)
    except ModelLayoutError as err:
        raise ConfigError(f"{prefix}{err}") from None
    _check_divides(prefix + "tensor_model_parallel_size * pipeline_model_parallel_size", tp * pp,
                   "trainer.nnodes * trainer.n_gpus_per_node", world)
    rollout_tp = rollout["tensor_model_parallel_size"]
    _check_divides("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout_tp, "world size", world)
    for key, value in (("num_attention_heads", model.num_attention_heads),
                       ("intermediate_size", model.intermediate_size)):
        _check_divides("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout_tp, key, value)
    dp = world // (tp * pp)
    rollout_dp = world // rollout_tp

    # Batch sizes: train batch -> mini-batches -> DP ranks -> micro-batches (all in responses).
    n = rollout["n"]
    train_bs = data["train_batch_size"]
    if train_bs % rollout_dp:
        raise ConfigError(f"data.train_batch_size={train_bs}: expected a multiple of the rollout DP size "
                          f"(world {world} / rollout tp {rollout_tp} = {rollout_dp})")
    roles = [("actor_rollout_ref.actor", actor)] + ([("critic", critic)] if use_critic(cfg) else [])
    for name, role in roles:
        mini = role["ppo_mini_batch_size"]
        _check_divides(f"{name}.ppo_mini_batch_size", mini, "data.train_batch_size", train_bs)
        _check_divides(f"{name}.ppo_mini_batch_size * rollout.n / dp ({dp})", dp,
                       f"{name}.ppo_mini_batch_size * rollout.n", mini * n)
        _check_divides(f"{name}.ppo_micro_batch_size_per_gpu", role["ppo_micro_batch_size_per_gpu"],
                       f"{name}.ppo_mini_batch_size * rollout.n / dp", mini * n // dp)
    for key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"):
        section, _, leaf = key.rpartition(".")
        micro = arr[section.split(".")[1]][leaf]
        _check_divides(key, micro, "data.train_batch_size * rollout.n / dp", train_bs * n // dp)
    if algo["adv_estimator"] in ("grpo", "rloo", "reinforce_plus_plus_baseline") and n < 2:
        raise ConfigError(f"actor_rollout_ref.rollout.n: expected >= 2 for {algo['adv_estimator']} "
                          f"(group baselines), found {n}")
    if model.max_position_embeddings < data["max_prompt_length"] + data["max_response_length"]:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length: expected <= the model's max_position_embeddings="
            f"{model.max_position_embeddings}, found {data['max_prompt_length'] + data['max_response_length']}")
    if cfg["reward_model"]["enable"]:
        _validate_reward_model(cfg, model, tp, pp, train_bs * n // dp)
        if algo["adv_estimator"] == "remax":  # the greedy baselines: one response per prompt
            _check_divides("reward_model.micro_batch_size_per_gpu", cfg["reward_model"]["micro_batch_size_per_gpu"],
                           "data.train_batch_size / dp (remax's greedy baselines)", train_bs // dp)
    elif cfg["reward_model"]["hot_swap"]["watch"] or cfg["reward_model"]["hot_swap"]["path"] is not None:
        raise ConfigError("reward_model.hot_swap: expected reward_model.enable=true to swap a reward model, "
                          "found it false")
    if launcher_world_size is not None and launcher_world_size != world:
        raise ConfigError(f"trainer.nnodes * trainer.n_gpus_per_node: expected the launcher's world size "
                          f"{launcher_world_size}, found {trainer['nnodes']} * {trainer['n_gpus_per_node']} = {world}")


def _validate_reward_model(cfg: dict[str, Any], actor_model: Any, tp: int, pp: int, per_dp_batch: int) -> None:
    from verl.models.config import ModelConfig, ModelConfigError
    from verl.models.mcore.model import ModelLayoutError, check_parallel_layout

    rm = cfg["reward_model"]
    _positive(cfg, "reward_model.micro_batch_size_per_gpu")
    _check_divides("reward_model.micro_batch_size_per_gpu", rm["micro_batch_size_per_gpu"],
                   "data.train_batch_size * rollout.n / dp", per_dp_batch)
    swap = rm["hot_swap"]
    if (swap["path"] is None) != (swap["at_step"] is None):
        raise ConfigError(f"reward_model.hot_swap.path and reward_model.hot_swap.at_step: expected both or neither, "
                          f"found path={swap['path']!r} at_step={swap['at_step']!r}")
    if swap["at_step"] is not None:
        _positive(cfg, "reward_model.hot_swap.at_step")
    for key in ("model.path", "hot_swap.path"):
        path = rm["model"]["path"] if key == "model.path" else swap["path"]
        if key == "hot_swap.path" and path is None:
            continue
        if path is None or not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"reward_model.{key}: expected an HF reward model directory (config.json + safetensors "
                              f"with score.weight), found {'null' if path is None else 'no config.json in ' + path}")
        try:
            model = ModelConfig.from_pretrained(path)
            check_parallel_layout(model, tp, pp)
        except (ModelConfigError, ModelLayoutError) as err:
            raise ConfigError(f"reward_model.{key}: {err}") from None
        if model.vocab_size != actor_model.vocab_size:
            raise ConfigError(f"reward_model.{key}: expected the actor's vocab_size={actor_model.vocab_size} (the "
                              f"reward model scores the actor's token ids), found {model.vocab_size}")


def read_config_tree(path: str | None, overrides: Sequence[str], schema: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Defaults of ``schema`` <- YAML file <- dotted overrides, each key and type checked.

    Returns the plain nested dict and the directory relative paths in the file resolve against
    (the repository root for a file in ``configs/``, else the file's directory; the working
    directory when there is no file). Shared by every YAML-configured command.
    """
    cfg = schema_defaults(schema)
    base_dir = os.getcwd()
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"--config: expected a YAML file, found nothing at {path}")
        with open(path, encoding="utf-8") as fh:
            try:
                loaded = yaml_io.safe_load(fh)
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                where = f" line {mark.line + 1}" if mark is not None else ""
                raise ConfigError(f"{path}:{where} expected valid YAML, found {getattr(err, 'problem', err)}") \
                    from None
            except UnicodeDecodeError as err:
                raise ConfigError(f"{path}: expected UTF-8 YAML, found byte {err.object[err.start]:#04x} at offset "
                                  f"{err.start}") from None
        merge_into_schema(cfg, loaded or {}, schema)
        config_dir = os.path.dirname(os.path.abspath(path))
        base_dir = os.path.dirname(config_dir) if os.path.basename(config_dir) == "configs" else config_dir
    for item in overrides:
        _apply_override(cfg, *_parse_override(item), schema)
    return cfg, base_dir


def load_config(path: str | None, overrides: Sequence[str] = (), launcher_world_size: int | None = None):
    """Defaults <- YAML file <- dotted overrides, validated; returns an OmegaConf DictConfig.

    Relative paths in the file (data files, tokenizer, model) resolve against the working directory
    first, then the repository root (the directory above ``configs/``).
    """
    from omegaconf import OmegaConf

    cfg, base_dir = read_config_tree(path, overrides, SCHEMA)

    data = cfg["data"]
    for key in ("train_files", "val_files"):
        if isinstance(data[key], list):
            data[key] = [resolve_path(p, base_dir) for p in data[key]]
        else:
            data[key] = resolve_path(data[key], base_dir)
    data["tokenizer"] = resolve_path(data["tokenizer"], base_dir)
    cfg["actor_rollout_ref"]["model"]["path"] = resolve_path(cfg["actor_rollout_ref"]["model"]["path"], base_dir)
    rm = cfg["reward_model"]
    rm["model"]["path"] = resolve_path(rm["model"]["path"], base_dir)
    rm["hot_swap"]["path"] = resolve_path(rm["hot_swap"]["path"], base_dir)
    cfg["critic"]["model"]["path"] = resolve_path(cfg["critic"]["model"]["path"], base_dir) \
        or cfg["actor_rollout_ref"]["model"]["path"]
    if cfg["trainer"]["default_local_dir"] is None:
        cfg["trainer"]["default_local_dir"] = os.path.join(cfg["trainer"]["output_dir"], "checkpoints")
    _validate(cfg, launcher_world_size)
    return OmegaConf.create(cfg)
