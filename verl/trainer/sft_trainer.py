"""``verl sft``: supervised fine-tuning on the Megatron engine, exported as an HF checkpoint.

    verl sft --config configs/sft_arith_tiny.yaml [data.label_noise=0.3 trainer.total_training_steps=50 ...]

The quickstart's warm start: prompt -> response pairs from parquet (verl's SFT keys), loss on the
response tokens and the eos after them (the prompt is masked), Adam + warmup/decay on Megatron
(TP x PP x DP), and the final weights written as ``<trainer.output_dir>/hf`` (config.json,
model.safetensors, tokenizer files, generation_config.json with eos), ready to be the RL actor.
``data.label_noise`` makes the warm start deliberately imperfect so that RL has room to improve it:
with ``data.label_noise_mode=random`` that fraction of the training targets gets another example's
answer; with ``drop_carry`` (arithmetic prompts ``a+b=`` / ``a-b=``) that fraction of the problems
that involve a carry (ones digits summing to >= 10) or a borrow gets the answer computed without it
(``37+48=`` -> ``75``, ``52-37=`` -> ``25``) -- a systematic, human-like error that the model learns
next to the right skill, so sampling still finds the right answer and RL's exact-match reward can
flip the greedy choice.

Ranks: under a launcher (Slurm, torchrun, mpirun) this process is one rank; otherwise ``verl sft``
runs ``trainer.nproc`` local ranks itself (gloo over loopback). Rank 0 shows a progress bar, prints
a loss line every ``trainer.log_freq`` steps and writes ``<output_dir>/metrics.jsonl``
(``train/loss``, ``train/lr``, ``train/grad_norm``, ``val/loss``; ``val/accuracy`` -- greedy exact
match of the exported model on ``data.val_files`` -- at the last step).

A config, data or model problem is reported as one line before any rank starts (exit 2) and
nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from verl.trainer.config import ConfigError, field, read_config_tree, resolve_path

USAGE_ERROR = 2
LOGGERS = ("console", "tensorboard")
LABEL_NOISE_MODES = ("random", "drop_carry")

SCHEMA: dict[str, Any] = {
    "data": {
        "train_files": field(None, str, list),
        "val_files": field(None, str, list),
        "prompt_key": field("prompt", str),
        "prompt_dict_keys": field(None, list),
        "response_key": field("response", str),
        "response_dict_keys": field(None, list),
        "max_length": field(64, int),
        "train_batch_size": field(64, int),
        "micro_batch_size_per_gpu": field(8, int),
        "label_noise": field(0.0, float),
        "label_noise_mode": field("random", choices=LABEL_NOISE_MODES),
    },
    "model": {
        "path": field(None, str),
        "tokenizer_path": field(None, str),
    },
    "optim": {
        "lr": field(1e-4, float),
        "betas": field([0.9, 0.95], list),
        "weight_decay": field(0.01, float),
        "warmup_steps_ratio": field(0.1, float),
        "clip_grad": field(1.0, float),
        "lr_scheduler": field("cosine", choices=("constant", "linear", "cosine")),
        "min_lr_ratio": field(0.0, float),
    },
    "megatron": {
        "tensor_model_parallel_size": field(1, int),
        "pipeline_model_parallel_size": field(1, int),
    },
    "trainer": {
        "project_name": field("verl_hpc_sft", str),
        "experiment_name": field("sft", str),
        "total_epochs": field(1, int),
        "total_training_steps": field(None, int),
        "output_dir": field("outputs/sft", str),
        "seed": field(1, int),
        "nproc": field(1, int),
        "logger": field(["console"], list),
        "log_freq": field(50, int),
        "test_freq": field(-1, int),
        "val_accuracy": field(True, bool),
        "val_max_new_tokens": field(8, int),
    },
}


# ----------------------------------------------------------------------------- config
def load_sft_config(path: str | None, overrides: Sequence[str] = (),
                    launcher_world_size: int | None = None) -> dict[str, Any]:
    """Defaults <- YAML file <- dotted overrides, with paths resolved and every key validated.

    Relative paths resolve against the working directory first, then the repository root (the
    directory above ``configs/``). Raises one :class:`ConfigError` naming the key.
    """
    cfg, base_dir = read_config_tree(path, overrides, SCHEMA)

    data = cfg["data"]
    for key in ("train_files", "val_files"):
        files = data[key]
        data[key] = [resolve_path(p, base_dir) for p in ([files] if isinstance(files, str) else files or [])]
    for key in ("path", "tokenizer_path"):
        cfg["model"][key] = resolve_path(cfg["model"][key], base_dir)
    _validate(cfg, launcher_world_size)
    return cfg


def _validate(cfg: dict[str, Any], launcher_world_size: int | None) -> None:
    from verl.models.config import ModelConfig, ModelConfigError
    from verl.models.mcore.model import ModelLayoutError, check_parallel_layout

    data, optim, trainer, mcore = cfg["data"], cfg["optim"], cfg["trainer"], cfg["megatron"]
    for section, key in (("data", "max_length"), ("data", "train_batch_size"), ("data", "micro_batch_size_per_gpu"),
                         ("trainer", "total_epochs"), ("trainer", "nproc"), ("trainer", "log_freq"),
                         ("trainer", "val_max_new_tokens"), ("megatron", "tensor_model_parallel_size"),
                         ("megatron", "pipeline_model_parallel_size")):
        if cfg[section][key] < 1:
            raise ConfigError(f"{section}.{key}: expected a positive integer, found {cfg[section][key]}")
    steps = trainer["total_training_steps"]
    if steps is not None and steps < 1:
        raise ConfigError(f"trainer.total_training_steps: expected a positive integer or null, found {steps}")
    if not 0.0 <= data["label_noise"] < 1.0:
        raise ConfigError(f"data.label_noise: expected a fraction in [0, 1), found {data['label_noise']}")
    if not 0.0 <= optim["warmup_steps_ratio"] <= 1.0:
        raise ConfigError(f"optim.warmup_steps_ratio: expected a fraction in [0, 1], "
                          f"found {optim['warmup_steps_ratio']}")
    if not 0.0 <= optim["min_lr_ratio"] <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio: expected a fraction in [0, 1], found {optim['min_lr_ratio']}")
    if optim["lr"] <= 0:
        raise ConfigError(f"optim.lr: expected a positive learning rate, found {optim['lr']}")
    if len(optim["betas"]) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in optim["betas"]):
        raise ConfigError(f"optim.betas: expected two numbers in [0, 1), found {optim['betas']}")
    for key in trainer["logger"]:
        if key not in LOGGERS:
            raise ConfigError(f"trainer.logger: expected entries among {list(LOGGERS)}, found {key!r}")
    for key in ("prompt_dict_keys", "response_dict_keys"):
        if data[key] is not None and not all(isinstance(k, str) for k in data[key]):
            raise ConfigError(f"data.{key}: expected a list of column names, found {data[key]!r}")
    if not data["train_files"]:
        raise ConfigError("data.train_files: expected a parquet file (or a list of them), found null")
    for key in ("train_files", "val_files"):
        for path in data[key]:
            if not os.path.isfile(path):
                raise ConfigError(f"data.{key}: expected an existing parquet file, found no file at {path} "
                                  f"(generate the quickstart data with `verl data arithmetic --out DIR`)")
    if cfg["model"]["path"] is None:
        raise ConfigError("model.path: expected an HF model directory or a config.json, found null")
    tokenizer_path = cfg["model"]["tokenizer_path"] or cfg["model"]["path"]
    if not os.path.isfile(os.path.join(tokenizer_path, "tokenizer_config.json")):
        raise ConfigError(f"model.tokenizer_path: expected a tokenizer directory (tokenizer_config.json), "
                          f"found none at {tokenizer_path}")
    cfg["model"]["tokenizer_path"] = tokenizer_path
    try:
        model = ModelConfig.from_pretrained(cfg["model"]["path"])
        check_parallel_layout(model, mcore["tensor_model_parallel_size"], mcore["pipeline_model_parallel_size"])
    except ModelConfigError as err:
        raise ConfigError(f"model.path: {err}") from None
    except ModelLayoutError as err:
        raise ConfigError(f"megatron.{err}") from None
    if data["max_length"] > model.max_position_embeddings:
        raise ConfigError(f"data.max_length: expected <= the model's max_position_embeddings="
                          f"{model.max_position_embeddings}, found {data['max_length']}")

    world = trainer["nproc"]
    if launcher_world_size is not None and launcher_world_size != world:
        raise ConfigError(f"trainer.nproc: expected the launcher's world size {launcher_world_size}, found {world}")
    model_parallel = mcore["tensor_model_parallel_size"] * mcore["pipeline_model_parallel_size"]
    if world % model_parallel:
        raise ConfigError(f"megatron.tensor_model_parallel_size * pipeline_model_parallel_size={model_parallel}: "
                          f"expected a divisor of trainer.nproc={world}")
    dp = world // model_parallel
    batch, micro = data["train_batch_size"], data["micro_batch_size_per_gpu"]
    if batch % dp or (batch // dp) % micro:
        raise ConfigError(f"data.micro_batch_size_per_gpu={micro}: expected a divisor of data.train_batch_size / dp "
                          f"= {batch} / {dp}")


# ----------------------------------------------------------------------------- data
@dataclasses.dataclass
class SFTData:
    """Tokenised pairs in the RL batch layout: left-padded prompt [N, P] then response + eos [N, R].

    ``input_ids``/``attention_mask`` [N, P+R]; ``responses`` [N, R]; ``response_mask`` [N, R] is 1
    on the response tokens and the eos (the tokens the loss sees). ``noisy`` counts relabelled rows.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    noisy: int = 0

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "responses": self.responses[index], "response_mask": self.response_mask[index]}


def _field(row: dict[str, Any], key: str, nested: list[str] | None, what: str) -> Any:
    value = row[key]
    for name in nested or []:
        if not isinstance(value, dict) or name not in value:
            raise ConfigError(f"data.{what}_dict_keys: expected key {name!r} inside column {key!r}, "
                              f"found {sorted(value) if isinstance(value, dict) else type(value).__name__}")
        value = value[name]
    return value


def _as_text(value: Any, tokenizer: Any) -> str:
    """A string, or chat messages rendered as the rollout renders them (RLHFDataset.prompt_text)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in value):
        from verl.utils.dataset.rl_dataset import render_prompt

        return render_prompt(value, tokenizer)
    return str(value)


def read_pairs(files: Sequence[str], data_cfg: dict[str, Any], tokenizer: Any) -> list[tuple]:
    """(prompt text, response text) for every row of ``files``."""
    import pyarrow.parquet as pq

    pairs = []
    for path in files:
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as err:
            raise ConfigError(f"data: cannot read parquet file {path}: {err}") from None
        for key, what in ((data_cfg["prompt_key"], "prompt"), (data_cfg["response_key"], "response")):
            if rows and key not in rows[0]:
                raise ConfigError(f"data.{what}_key: expected a column of {path}, found {key!r} missing "
                                  f"(columns: {sorted(rows[0])})")
        for row in rows:
            prompt = _field(row, data_cfg["prompt_key"], data_cfg["prompt_dict_keys"], "prompt")
            response = _field(row, data_cfg["response_key"], data_cfg["response_dict_keys"], "response")
            pairs.append((_as_text(prompt, tokenizer), _as_text(response, tokenizer)))
    if not pairs:
        raise ConfigError(f"data: expected at least one row in {list(files)}, found none")
    return pairs


def add_label_noise(pairs: list[tuple], fraction: float, seed: int) -> tuple:
    """(pairs, count): ``round(fraction * N)`` seeded rows get another row's different response."""
    rng = random.Random(seed)
    responses = [r for _, r in pairs]
    if len(set(responses)) < 2:
        return pairs, 0
    noisy = list(pairs)
    chosen = rng.sample(range(len(pairs)), round(fraction * len(pairs)))
    for i in chosen:
        wrong = responses[i]
        while wrong == responses[i]:
            wrong = responses[rng.randrange(len(responses))]
        noisy[i] = (pairs[i][0], wrong)
    return noisy, len(chosen)


_PROBLEM = re.compile(r"^\s*(\d+)\s*([+-])\s*(\d+)\s*=\s*$")


def drop_carry_answer(prompt: str) -> str | None:
    """The answer to ``a+b=`` / ``a-b=`` computed by forgetting the carry out of (or the borrow into)
    the ones digit, or None when the problem has none (or is not such a prompt).

    ``37+48=`` -> ``75`` (7+8=15: write 5, forget the 1); ``12+13=`` -> None; ``52-37=`` -> ``25``
    (2-7: borrow to get 5, forget to take it from the tens); ``37-52=`` -> ``-25`` (the same slip on
    52-37, sign kept).
    """
    match = _PROBLEM.match(prompt)
    if match is None:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    if op == "+":
        return str(a + b - 10) if a % 10 + b % 10 >= 10 else None
    big, small, sign = (a, b, "") if a >= b else (b, a, "-")
    if big % 10 >= small % 10:
        return None
    return sign + str(big - small + 10)


def add_drop_carry_noise(pairs: list[tuple], fraction: float, seed: int) -> tuple:
    """(pairs, count): ``round(fraction * M)`` seeded rows of the M that involve a carry (or borrow)
    get the carry-dropped answer (:func:`drop_carry_answer`) as their response."""
    rng = random.Random(seed)
    dropped = {i: drop_carry_answer(p) for i, (p, _) in enumerate(pairs)}
    candidates = [i for i, answer in dropped.items() if answer is not None]
    noisy = list(pairs)
    chosen = rng.sample(candidates, round(fraction * len(candidates)))
    for i in chosen:
        noisy[i] = (pairs[i][0], dropped[i])
    return noisy, len(chosen)


def encode_pairs(pairs: list[tuple], tokenizer: Any, max_length: int) -> list[tuple]:
    """(prompt ids, response ids + eos) per pair; every pair must fit in ``max_length`` tokens."""
    encoded = [(tokenizer(p, add_special_tokens=False)["input_ids"],
                tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]) for p, r in pairs]
    longest = max(len(p) + len(r) for p, r in encoded)
    if longest > max_length:
        raise ConfigError(f"data.max_length: expected every prompt + response + eos to fit, found {longest} tokens "
                          f"> {max_length}")
    return encoded


def pad_pairs(encoded: list[tuple], prompt_width: int, response_width: int, pad_token_id: int) -> SFTData:
    """SFTData: prompts left-padded to ``prompt_width``, responses right-padded to ``response_width``."""
    P, R = prompt_width, response_width
    ids = torch.full((len(encoded), P + R), pad_token_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(encoded):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(r)] = torch.tensor(r)
        mask[i, P - len(p):P + len(r)] = 1
    return SFTData(ids, mask, ids[:, P:].clone(), mask[:, P:].clone())


def prepare_data(cfg: dict[str, Any]) -> tuple:
    """(train SFTData, val SFTData or None, tokenizer): every data problem raises ConfigError here.

    Train and val share one (prompt, response) width: the longest of either, over both splits.
    """
    from transformers import AutoTokenizer

    from verl.models.config import ModelConfig

    data = cfg["data"]
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"]["tokenizer_path"])
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ConfigError(f"model.tokenizer_path: expected a tokenizer with eos and pad tokens, found eos="
                          f"{tokenizer.eos_token_id} pad={tokenizer.pad_token_id}")
    vocab = ModelConfig.from_pretrained(cfg["model"]["path"]).vocab_size
    if len(tokenizer) > vocab:
        raise ConfigError(f"model.path: expected vocab_size >= the tokenizer's {len(tokenizer)} tokens, found {vocab}")
    train_pairs = read_pairs(data["train_files"], data, tokenizer)
    if len(train_pairs) < data["train_batch_size"]:
        raise ConfigError(f"data.train_batch_size: expected at most the {len(train_pairs)} training rows, "
                          f"found {data['train_batch_size']}")
    noise = add_drop_carry_noise if data["label_noise_mode"] == "drop_carry" else add_label_noise
    train_pairs, noisy = noise(train_pairs, data["label_noise"], cfg["trainer"]["seed"])
    train = encode_pairs(train_pairs, tokenizer, data["max_length"])
    val = encode_pairs(read_pairs(data["val_files"], data, tokenizer), tokenizer, data["max_length"]) \
        if data["val_files"] else []
    widths = (max(len(p) for p, _ in train + val), max(len(r) for _, r in train + val))
    train_data = pad_pairs(train, *widths, tokenizer.pad_token_id)
    train_data.noisy = noisy
    return train_data, pad_pairs(val, *widths, tokenizer.pad_token_id) if val else None, tokenizer


def total_steps(cfg: dict[str, Any], num_train: int) -> int:
    steps = cfg["trainer"]["total_training_steps"]
    if steps is not None:
        return steps
    return max(1, num_train // cfg["data"]["train_batch_size"]) * cfg["trainer"]["total_epochs"]


# ----------------------------------------------------------------------------- one rank
def sft_loss(outputs: dict[str, torch.Tensor], micro_batch: dict[str, torch.Tensor]):
    """Token-mean negative log-likelihood over the response tokens (and eos): log_probs [b, R]."""
    mask = micro_batch["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum().clamp(min=1.0), {}


class SFTTrainer:
    """SFT on this rank's Megatron groups (torch.distributed initialised, megatron not yet)."""

    def __init__(self, cfg: dict[str, Any], train: SFTData, val: SFTData | None):
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        from verl.engine.megatron.actor import MegatronActor
        from verl.engine.megatron.engine import MegatronEngine, OptimConfig
        from verl.engine.megatron.parallel import initialize_megatron
        from verl.models.config import ModelConfig
        from verl.models.mcore.weights import HFCheckpoint, load_hf_into_model

        self.cfg, self.train_data, self.val_data = cfg, train, val
        mcore, optim, trainer = cfg["megatron"], cfg["optim"], cfg["trainer"]
        self.rank = dist.get_rank()
        initialize_megatron(mcore["tensor_model_parallel_size"], mcore["pipeline_model_parallel_size"],
                            seed=trainer["seed"])
        self.dp_size, self.dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        self.steps = total_steps(cfg, len(train))
        self.model_config = ModelConfig.from_pretrained(cfg["model"]["path"])
        self.engine = MegatronEngine(self.model_config, "lm", OptimConfig(
            lr=optim["lr"], min_lr=optim["lr"] * optim["min_lr_ratio"], weight_decay=optim["weight_decay"],
            betas=tuple(optim["betas"]), clip_grad=optim["clip_grad"],
            lr_warmup_steps=int(optim["warmup_steps_ratio"] * self.steps), total_training_steps=self.steps,
            lr_decay_style=optim["lr_scheduler"]))
        if os.path.isdir(cfg["model"]["path"]) and _has_weights(cfg["model"]["path"]):
            load_hf_into_model(self.engine.module, self.model_config, HFCheckpoint(cfg["model"]["path"]).get)
        self.actor = MegatronActor(self.engine, cfg["data"]["micro_batch_size_per_gpu"])

    def _global_batches(self):
        """Seeded reshuffle every epoch; the last partial batch of an epoch is dropped."""
        size, n = self.cfg["data"]["train_batch_size"], len(self.train_data)
        epoch = 0
        while True:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg["trainer"]["seed"] + epoch))
            for start in range(0, n - size + 1, size):
                yield order[start:start + size]
            epoch += 1

    def val_loss(self) -> float | None:
        if self.val_data is None:
            return None
        from verl.engine.megatron.actor import token_log_probs

        batch = self.val_data.batch(torch.arange(len(self.val_data)))
        out = self.engine.forward(batch, len(self.val_data), token_log_probs(self.engine, compute_entropy=False))
        return float(sft_loss(out, batch)[0])

    def fit(self, tracker: Any = None) -> dict[str, Any]:
        """Train ``total_training_steps``; returns the last step's metrics (logged by the caller,
        which adds the exported model's ``val/accuracy`` to the same record)."""
        from tqdm import tqdm

        trainer = self.cfg["trainer"]
        share = self.cfg["data"]["train_batch_size"] // self.dp_size
        tokens_per_step = int(self.train_data.attention_mask.sum()) * self.cfg["data"]["train_batch_size"] \
            / len(self.train_data)
        bar = tqdm(total=self.steps, desc="sft", unit="step", dynamic_ncols=True, disable=self.rank != 0)
        batches = self._global_batches()
        metrics: dict[str, Any] = {}
        start = time.perf_counter()
        for step in range(1, self.steps + 1):
            tick = time.perf_counter()
            index = next(batches)[self.dp_rank * share:(self.dp_rank + 1) * share]
            out = self.actor.update_policy(self.train_data.batch(index), sft_loss, calculate_entropy=False)
            elapsed = time.perf_counter() - tick
            metrics = {"train/loss": out["loss"], "train/lr": out["lr"], "train/grad_norm": out["grad_norm"],
                       "timing_s/step": elapsed, "perf/tokens_per_s": tokens_per_step / elapsed}
            last = step == self.steps
            if last or (trainer["test_freq"] > 0 and step % trainer["test_freq"] == 0):
                metrics["val/loss"] = self.val_loss()
            if last:
                metrics["timing_s/train"] = time.perf_counter() - start
            if tracker is not None and not last:
                tracker.log({k: v for k, v in metrics.items() if v is not None}, step)
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.4f}")
            if self.rank == 0 and (last or step % trainer["log_freq"] == 0 or step == 1):
                bar.write(_loss_line(step, self.steps, metrics))
        bar.close()
        return metrics

    def export_hf(self, out_dir: str, tokenizer: Any) -> str | None:
        """Stream the actor (collective over every rank) into ``out_dir``, written by rank 0 atomically:
        config.json with the tokenizer's special token ids, and a greedy generation_config.json."""
        from megatron.core import parallel_state as mpu

        from verl.models.hf_export import export_model_hf, read_hf_config, special_token_ids

        hf_config = read_hf_config(self.cfg["model"]["path"])
        special = special_token_ids(tokenizer, {})
        hf_config.update(special)
        written = export_model_hf(self.engine.module, self.model_config, out_dir, hf_config, tokenizer,
                                  {**special, "do_sample": False}, gather=mpu.get_data_parallel_rank() == 0)
        return written if self.rank == 0 else None


def _has_weights(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def _loss_line(step: int, steps: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}/{steps}", f"loss {metrics['train/loss']:.4f}"]
    if metrics.get("val/loss") is not None:
        parts.append(f"val_loss {metrics['val/loss']:.4f}")
    parts += [f"lr {metrics['train/lr']:.3g}", f"grad_norm {metrics['train/grad_norm']:.3g}",
              f"{metrics['timing_s/step'] * 1e3:.0f} ms/step"]
    return " | ".join(parts)


def run_rank(cfg: dict[str, Any], train: SFTData, val: SFTData | None) -> dict[str, Any]:
    """One rank's whole job (torch.distributed initialised): train, export ``<output_dir>/hf``, rank 0
    scores it; returns the final metrics (module level, so ``run_ranks`` can pickle it)."""
    import torch.distributed as dist

    from verl.engine.megatron.parallel import destroy_megatron
    from verl.trainer.evaluate import evaluate_accuracy
    from verl.utils.tracking import Tracking

    # megatron's CPU fallbacks (no TE / apex) warn once per module on every rank: not the user's concern.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
    trainer_cfg = cfg["trainer"]
    output_dir = os.path.abspath(trainer_cfg["output_dir"])
    tracker = None
    if dist.get_rank() == 0:
        os.makedirs(output_dir, exist_ok=True)
        # A rerun restarts from scratch: drop the previous run's logs (the hf dir is replaced at export).
        if os.path.exists(os.path.join(output_dir, "metrics.jsonl")):
            os.remove(os.path.join(output_dir, "metrics.jsonl"))
        shutil.rmtree(os.path.join(output_dir, "tensorboard"), ignore_errors=True)
        backends = [b for b in trainer_cfg["logger"] if b != "console"]  # the console gets loss lines
        tracker = Tracking(output_dir, backends, trainer_cfg["project_name"], trainer_cfg["experiment_name"])
        with open(os.path.join(output_dir, "sft_config.json"), "w", encoding="utf-8") as fh:
            json.dump(cfg, fh, indent=2)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg["model"]["tokenizer_path"])
    sft = SFTTrainer(cfg, train, val)
    try:
        metrics = sft.fit(tracker)
        hf_dir = sft.export_hf(os.path.join(output_dir, "hf"), tokenizer)
    finally:
        destroy_megatron()
    if tracker is None:
        return metrics
    if trainer_cfg["val_accuracy"] and cfg["data"]["val_files"]:
        tick = time.perf_counter()
        metrics["val/accuracy"] = evaluate_accuracy(hf_dir, cfg["data"]["val_files"],
                                                    max_new_tokens=trainer_cfg["val_max_new_tokens"])
        metrics["timing_s/val_accuracy"] = time.perf_counter() - tick
    tracker.log({k: v for k, v in metrics.items() if v is not None}, sft.steps)
    tracker.close()
    return {**metrics, "hf_dir": hf_dir}


# ----------------------------------------------------------------------------- CLI
def _parse_args(argv: list[str]):
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line instead of usage + message
            raise ConfigError(message)

    parser = Parser(prog="verl sft", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (e.g. configs/sft_arith_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_training_steps=10")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from verl.launcher.env import LaunchError, discover
    from verl.launcher.spawn import RankFailure, run_ranks

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        env = discover()
        launched = env.source != "local"
        args = _parse_args(argv)
        cfg = load_sft_config(args.config, args.overrides, env.world_size if launched else None)
        train, val, _ = prepare_data(cfg)
    except (ConfigError, LaunchError) as err:
        print(f"verl sft: {err}", file=sys.stderr)
        return USAGE_ERROR

    tick = time.perf_counter()
    if launched:
        from verl.launcher.bootstrap import destroy_distributed, init_distributed

        init_distributed(seed=cfg["trainer"]["seed"])
        try:
            metrics = run_rank(cfg, train, val)
        finally:
            destroy_distributed()
        if env.rank != 0:
            return 0
    else:
        nproc = cfg["trainer"]["nproc"]
        # As torchrun does: the ranks share this host's cores (OMP_NUM_THREADS, when set, wins).
        threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, (os.cpu_count() or 1) // nproc)
        try:
            metrics = run_ranks(run_rank, nproc, cfg, train, val, timeout_s=math.inf, threads_per_rank=threads)[0]
        except RankFailure as err:
            print(f"verl sft: {err}", file=sys.stderr)
            return 1
    accuracy = metrics.get("val/accuracy")
    print(f"sft: {total_steps(cfg, len(train))} steps in {time.perf_counter() - tick:.1f}s | "
          f"final loss {metrics['train/loss']:.4f}"
          + (f" | val/loss {metrics['val/loss']:.4f}" if metrics.get("val/loss") is not None else "")
          + (f" | val/accuracy {accuracy:.3f}" if accuracy is not None else "")
          + f" | {train.noisy}/{len(train)} noisy labels | hf -> {metrics['hf_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
