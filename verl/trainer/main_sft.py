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
nothing is written. The config schema and its validation live here; the trainer is
:mod:`verl.trainer.sft_trainer`, the data :mod:`verl.utils.dataset.sft_dataset`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from verl.errors import EXIT_INTERNAL_ERROR, InputError
from verl.trainer.config.loader import PACKAGED_CONFIG_DIR, ConfigError, Rule, compose, resolve_path
from verl.trainer.config.sft import SFTSections
from verl.trainer.sft_trainer import run_rank, total_steps
from verl.utils.dataset.sft_dataset import prepare_data
from verl.utils.tracking import check_backends

USAGE_ERROR = 2

CONFIG_NAME = "sft_trainer"  # verl/trainer/config/sft_trainer.yaml: the keys and their defaults
# Every key's type and range, from its typed section (verl/trainer/config/sft.py).
RULES: dict[str, Rule] = SFTSections.rules("")


def read_sft_config_tree(path: str | None, overrides: Sequence[str] = ()) -> tuple[dict[str, Any], str]:
    """The packaged SFT defaults <- YAML file <- overrides, types and ranges checked (no file checks)."""
    return compose(PACKAGED_CONFIG_DIR, CONFIG_NAME, path, overrides, RULES)


# ----------------------------------------------------------------------------- config
def load_sft_config(path: str | None, overrides: Sequence[str] = (),
                    launcher_world_size: int | None = None) -> dict[str, Any]:
    """Defaults <- YAML file <- dotted overrides, with paths resolved and every key validated.

    Relative paths resolve against the working directory first, then the repository root (the
    directory above ``configs/``). Raises one :class:`ConfigError` naming the key.
    """
    cfg, base_dir = read_sft_config_tree(path, overrides)

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
    if not 0.0 <= data["label_noise"] < 1.0:
        raise ConfigError(f"data.label_noise: expected a fraction in [0, 1), found {data['label_noise']}")
    if len(optim["betas"]) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in optim["betas"]):
        raise ConfigError(f"optim.betas: expected two numbers in [0, 1), found {optim['betas']}")
    if isinstance(trainer["logger"], str):
        trainer["logger"] = [trainer["logger"]]
    try:
        check_backends(trainer["logger"])
    except ValueError as err:  # check_backends: an unknown logger name
        raise ConfigError(str(err)) from None
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
    if batch % dp:
        raise ConfigError(f"data.train_batch_size={batch}: expected a multiple of dp={dp} (as verl)")
    # A micro-batch at least the rank's batch is one micro-batch (verl's split); a shorter last micro-batch is not
    # taken: the step averages the micro-batches' losses equally, so its rows would count more than the others'.
    if micro < batch // dp and (batch // dp) % micro:
        raise ConfigError(f"data.micro_batch_size_per_gpu={micro}: expected a divisor of data.train_batch_size / dp "
                          f"= {batch} / {dp} or at least {batch // dp} (one micro-batch), found remainder "
                          f"{(batch // dp) % micro}: the step averages equal micro-batches' losses")


def load_data(cfg: dict[str, Any]) -> tuple:
    """(train SFTData, val SFTData or None, tokenizer) for a validated config: the dataset checks the
    tokenizer against the model's vocabulary."""
    from verl.models.config import ModelConfig

    return prepare_data(cfg, ModelConfig.from_pretrained(cfg["model"]["path"]).vocab_size)


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
    from verl.launcher.env import discover
    from verl.launcher.spawn import RankFailure, run_ranks
    from verl.launcher.threads import intra_op_threads

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        env = discover()
        launched = env.source != "local"
        args = _parse_args(argv)
        cfg = load_sft_config(args.config, args.overrides, env.world_size if launched else None)
        train, val, _ = load_data(cfg)
    except InputError as err:  # ConfigError, DatasetError, LaunchError, ...
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
        threads = intra_op_threads(nproc)  # the ranks share this host's cores, as verl train's do
        try:
            metrics = run_ranks(run_rank, nproc, cfg, train, val, timeout_s=math.inf, threads_per_rank=threads)[0]
        except RankFailure as err:
            print(f"verl sft: {err}", file=sys.stderr)
            return EXIT_INTERNAL_ERROR
    accuracy = metrics.get("val/accuracy")
    print(f"sft: {total_steps(cfg, len(train))} steps in {time.perf_counter() - tick:.1f}s | "
          f"final loss {metrics['train/loss']:.4f}"
          + (f" | val/loss {metrics['val/loss']:.4f}" if metrics.get("val/loss") is not None else "")
          + (f" | val/accuracy {accuracy:.3f}" if accuracy is not None else "")
          + f" | {train.noisy}/{len(train)} noisy labels | hf -> {metrics['hf_dir']}")
    return 0


if __name__ == "__main__":
    from verl.launcher.bootstrap import exit_process

    exit_process(main())