"""``verl sft``'s typed config sections (the keys of ``sft_trainer.yaml``), built like the PPO trainer's
(:mod:`verl.trainer.config.sections`): one typed field per YAML key, its rule in the field's metadata, no defaults
(they live in the YAML). ``verl sft`` checks the composed config with :meth:`SFTSections.rules`; the SFT trainer
reads its keys through :class:`SFTSections` and hands the engine registry the sections a role's engine reads
(:func:`sft_engine_sections`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from verl.workers.config.section import Section, checked

frozen = dataclasses.dataclass(frozen=True)

LABEL_NOISE_MODES = ("random", "drop_carry")
LR_SCHEDULERS = ("constant", "linear", "cosine")


@frozen
class SFTDataConfig(Section):
    """``data``: the prompt -> response parquet files, the sequence length and the batches."""

    train_files: str | list | None
    val_files: str | list | None
    prompt_key: str
    prompt_dict_keys: list | None
    response_key: str
    response_dict_keys: list | None
    max_length: int = checked(ge=1)
    train_batch_size: int = checked(ge=1)
    micro_batch_size_per_gpu: int = checked(ge=1)
    label_noise: float = checked(ge=0)  # and < 1 (main_sft's checks)
    label_noise_mode: str = checked(choices=LABEL_NOISE_MODES)


@frozen
class SFTModelConfig(Section):
    """``model``: the HF directory (or config.json) training starts from, and the tokenizer."""

    path: str | None
    tokenizer_path: str | None


@frozen
class SFTOptimConfig(Section):
    """``optim``: Adam with warm-up and decay (``lr_scheduler``) down to ``min_lr_ratio * lr``."""

    lr: float = checked(gt=0)
    betas: list
    weight_decay: float = checked(ge=0)
    warmup_steps_ratio: float = checked(ge=0, le=1)
    clip_grad: float = checked(ge=0)
    lr_scheduler: str = checked(choices=LR_SCHEDULERS)
    min_lr_ratio: float = checked(ge=0, le=1)


@frozen
class SFTMegatronConfig(Section):
    """``megatron``: the model-parallel layout (the rest of the ranks is data parallel)."""

    tensor_model_parallel_size: int = checked(ge=1)
    pipeline_model_parallel_size: int = checked(ge=1)


@frozen
class SFTTrainerConfig(Section):
    """``trainer``: the run's length, ranks, logging and the final accuracy check."""

    project_name: str
    experiment_name: str
    total_epochs: int = checked(ge=1)
    total_training_steps: int | None = checked(ge=1)
    output_dir: str
    seed: int
    nproc: int = checked(ge=1)
    logger: list | str
    log_freq: int = checked(ge=1)
    test_freq: int = checked(ge=-1)
    val_accuracy: bool
    val_max_new_tokens: int = checked(ge=1)


@frozen
class SFTSections(Section):
    """Every section of a ``verl sft`` config, typed (the root: key "")."""

    data: SFTDataConfig
    model: SFTModelConfig
    optim: SFTOptimConfig
    megatron: SFTMegatronConfig
    trainer: SFTTrainerConfig


def sft_total_steps(sections: SFTSections, num_train: int) -> int:
    """``trainer.total_training_steps``, else the full batches of ``total_epochs`` passes (at least one a pass)."""
    trainer = sections.trainer
    if trainer.total_training_steps is not None:
        return trainer.total_training_steps
    return max(1, num_train // sections.data.train_batch_size) * trainer.total_epochs


def sft_engine_sections(sections: SFTSections, total_training_steps: int) -> tuple[Any, Any]:
    """(role, optim): the SFT keys as the sections a role's Megatron engine reads from its ``EngineSpec``
    (verl's ``megatron`` and ``optim`` keys): fp32 parameters, no distributed optimizer, the layout seeded with
    ``trainer.seed``; warm-up ``warmup_steps_ratio`` of the steps, decay to ``min_lr_ratio * lr``."""
    from omegaconf import OmegaConf

    mcore, optim = sections.megatron, sections.optim
    role = OmegaConf.create({"megatron": {
        "tensor_model_parallel_size": mcore.tensor_model_parallel_size,
        "pipeline_model_parallel_size": mcore.pipeline_model_parallel_size,
        "seed": sections.trainer.seed, "dtype": "float32", "use_distributed_optimizer": False}})
    engine_optim = OmegaConf.create({
        "lr": optim.lr, "min_lr": optim.lr * optim.min_lr_ratio, "weight_decay": optim.weight_decay,
        "betas": list(optim.betas), "clip_grad": optim.clip_grad,
        "lr_warmup_steps": -1, "lr_warmup_steps_ratio": optim.warmup_steps_ratio, "lr_warmup_init": 0.0,
        "lr_decay_steps": None, "lr_decay_style": optim.lr_scheduler})
    return role, engine_optim
