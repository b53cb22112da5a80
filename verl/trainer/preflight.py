"""Everything ``verl train`` can check before a rank starts: the loggers, the tokenizer, the rollout
engine, the model directories, one pass over each dataset, an explicit resume checkpoint. Each problem is
one ``ConfigError`` / ``DatasetError`` / ``CheckpointError`` line (exit 2), so no rank ever starts on input
it would fail on at step 3, and nothing is written for a run that cannot start."""

from __future__ import annotations

import json
import os
from typing import Any

from verl.engine.strategies import engine_name
from verl.errors import InputError
from verl.models.hf_io import model_dir_problem
from verl.trainer.config.sections import PPOSections
from verl.utils.checkpoint import CheckpointError, checkpoint_problem
from verl.utils.dataset.errors import DatasetError
from verl.utils.tracking import check_backends


class PreflightError(InputError):
    """Input that would make a rank fail: one line naming what was expected and what was found."""


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")) and \
            not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise PreflightError(f"data.tokenizer: expected a tokenizer directory (tokenizer.json or "
                             f"tokenizer_config.json), found none in {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PreflightError(f"data.tokenizer: expected a tokenizer transformers can load from {path}, "
                             f"found: {first}") from None
    if tokenizer.pad_token_id is None:
        raise PreflightError(f"data.tokenizer: expected a pad token in {path}, found pad_token_id=None")
    return tokenizer


def check_model_dir(key: str, path: str | None) -> None:
    """An HF model directory's safetensors are whole (a bare config.json means a seeded init)."""
    if path and os.path.isdir(path):
        problem = model_dir_problem(path)
        if problem is not None:
            raise PreflightError(f"{key}: {problem}")


def check_datasets(config: PPOSections, tokenizer: Any) -> None:
    """One pass over the train and val files with the trainer's own dataset (verl's train/val_max_samples,
    filter_overlong_prompts and truncation semantics): a bad row fails here, not at step N; the rows left
    after the limit and the filter must make one batch."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    data = config.data
    need_ground_truth = not config.reward_model.enable
    train = RLHFDataset(data.train_files, tokenizer, data, max_samples=data.train_max_samples)
    train.check(min_rows=data.train_batch_size, need_ground_truth=need_ground_truth)
    if data.val_files:
        RLHFDataset(data.val_files, tokenizer, data, max_samples=data.val_max_samples).check(
            min_rows=1, need_ground_truth=need_ground_truth)


def check_rollout_engine(config: PPOSections) -> None:
    """The rollout engine can start here: one that lives in its own environment (SGLang, vLLM) finds its package in
    this Python, and the engine's own limits on the model and rollout tp (SGLang on CPU pads attention heads instead
    of replicating KV heads)."""
    import sys

    from verl.engine.rollout.registry import rollout_engine

    rollout = config.actor_rollout_ref.rollout
    engine = rollout_engine(rollout.name)
    if engine.check_model is not None:  # the config's limits first: they hold wherever the engine is installed
        from verl.models.config import ModelConfig

        try:
            engine.check_model(ModelConfig.from_pretrained(config.actor_rollout_ref.model.path),
                               rollout.tensor_model_parallel_size)
        except InputError as err:
            message = str(err)  # named by its key already, or a rollout tp's limit
            named = message.startswith("actor_rollout_ref.")
            raise PreflightError(("" if named else "actor_rollout_ref.rollout.tensor_model_parallel_size: ") + message
                                 ) from None
    package = engine.capabilities.python_env
    if package is not None:
        from verl.utils.engine_env import ENGINE_ENVS, importable

        if not importable(package):
            env = ENGINE_ENVS[package]
            raise PreflightError(
                f"actor_rollout_ref.rollout.name={rollout.name}: expected {env.name} importable by {sys.executable}, "
                f"found none; `bash {env.setup}` builds {env.venv} ({env.name} and Megatron), then run "
                f"{env.venv}/bin/verl train ... (launch/quickstart.sh does both)")


def preflight(config: PPOSections) -> None:
    """Raises PreflightError, DatasetError or CheckpointError (all InputErrors: exit 2)."""
    try:
        check_backends(list(config.trainer.logger))  # e.g. `wandb` asked for but not installed
    except ValueError as err:
        raise PreflightError(str(err)) from None
    tokenizer = load_tokenizer(config.data.tokenizer)
    check_rollout_engine(config)
    check_model_dir("actor_rollout_ref.model.path", config.actor_rollout_ref.model.path)
    check_model_dir("critic.model.path", config.critic.model.path)
    if config.reward_model.enable:
        check_model_dir("reward_model.model.path", config.reward_model.model.path)
    check_datasets(config, tokenizer)
    trainer = config.trainer
    if trainer.resume_mode not in ("auto", "disable"):
        path = trainer.resume_from_path if trainer.resume_mode == "resume_path" else trainer.resume_mode
        problem = checkpoint_problem(os.path.abspath(path))
        if problem is not None:
            key = "trainer.resume_from_path" if trainer.resume_mode == "resume_path" else "trainer.resume_mode"
            raise CheckpointError(f"{key}: {problem}")
    check_resume_backend(config)


def check_resume_backend(config: PPOSections) -> None:
    """The checkpoint a run would resume from holds the configured backend's actor (a Megatron checkpoint
    cannot be read by FSDP and the other way round: their sharded formats differ)."""
    from verl.utils.checkpoint import find_resume_dir

    trainer = config.trainer
    if trainer.resume_mode == "disable":
        return
    path = find_resume_dir(trainer.default_local_dir, trainer.resume_mode, trainer.resume_from_path)
    manifest = os.path.join(path, "actor", "verl_checkpoint.json") if path else None
    if manifest is None or not os.path.isfile(manifest):
        return
    with open(manifest, encoding="utf-8") as fh:
        saved = json.load(fh).get("strategy", "megatron")
    wanted = engine_name(config.actor_rollout_ref.actor.strategy)  # what its checkpoints record
    if saved != wanted:
        raise CheckpointError(f"trainer.resume_mode: expected a checkpoint of actor_rollout_ref.actor.strategy="
                              f"{config.actor_rollout_ref.actor.strategy} to resume from, found a {saved} checkpoint "
                              f"in {path} (set trainer.resume_mode=disable or another trainer.output_dir)")


__all__ = ["DatasetError", "PreflightError", "preflight"]
