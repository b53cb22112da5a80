"""Helpers shared by the roles (actor/rollout/ref, critic, reward model) on either training backend
(``strategy``: megatron, or fsdp / fsdp2 = FSDP2): parallel state, engines, optimizer config, initial
weights, PPO mini-batches, batch fields and metrics."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from verl.models.config import ModelConfig
from verl.protocol import DataProto
from verl.single_controller import MeshRank
from verl.utils.device import get_device

ACTOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses")
FSDP_STRATEGIES = ("fsdp", "fsdp2")  # verl: fsdp = FSDP1, fsdp2 = FSDP2; both run on FSDP2 here
VERL_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the dtype table has the long names


def is_fsdp(strategy: str) -> bool:
    return strategy in FSDP_STRATEGIES


def ensure_megatron(tp: int, pp: int, seed: int) -> None:
    """Initialise Megatron's parallel state once per process (colocated roles share it)."""
    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.parallel import initialize_megatron

    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"megatron layout: expected (tp, pp) = {have} for every colocated role, found {(tp, pp)}")
        return
    initialize_megatron(tp, pp, seed=seed)

def megatron_mesh() -> MeshRank:
    """This rank's Megatron DP replica; its output is collected on the last stage's tp rank 0."""
    from megatron.core import parallel_state as mpu

    return MeshRank(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                    mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0)

def fsdp_dp_mesh() -> MeshRank:
    """Under FSDP every rank is its own DP replica and returns its own output."""
    import torch.distributed as dist

    return MeshRank(dist.get_rank(), dist.get_world_size(), True)


def dp_group_and_size(strategy: str) -> tuple[Any, int]:
    """(process group, size) the role's batch is split over: Megatron's DP group, or the world under FSDP."""
    import torch.distributed as dist

    if is_fsdp(strategy):
        return dist.group.WORLD, dist.get_world_size()
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_group(), mpu.get_data_parallel_world_size()


def fsdp_engine(model_config: ModelConfig, model_path: str, head: str, role: Any, model: Any = None,
                optim: Any = None, seed: int = 0):
    """An FSDPEngine from a role's verl keys: ``fsdp_config`` (``fsdp_size``, ``model_dtype``,
    ``mixed_precision.{param,reduce}_dtype``, ``offload_policy``, ``reshard_after_forward``) and the
    actor's ``model`` section (``enable_gradient_checkpointing``, ``use_remove_padding``)."""
    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.fsdp.parallel import fsdp_mesh
    from verl.utils.device import is_cuda_available
    from verl.utils.torch_dtypes import torch_dtype

    def dtype(name: str | None):  # verl writes FSDP dtypes short (fp32, bf16)
        return torch_dtype(VERL_DTYPE_NAMES.get(name, name)) if name else None

    fsdp = role.get("fsdp_config") or {}
    mixed = fsdp.get("mixed_precision") or {}
    gpu = is_cuda_available()
    # Unset: bf16 compute with fp32 gradient reductions on GPUs (verl's default), the master dtype on the CPU.
    model = model or {}
    return FSDPEngine(
        model_config, model_path, fsdp_mesh(fsdp.get("fsdp_size", -1)), head, optim,
        model_dtype=dtype(fsdp.get("model_dtype") or "fp32"),
        param_dtype=dtype(mixed.get("param_dtype") or ("bfloat16" if gpu else None)),
        reduce_dtype=dtype(mixed.get("reduce_dtype") or ("float32" if gpu else None)),
        offload=bool(fsdp.get("offload_policy") or fsdp.get("param_offload")),
        reshard_after_forward=bool(fsdp.get("reshard_after_forward", True)),
        gradient_checkpointing=bool(model.get("enable_gradient_checkpointing", False)),
        remove_padding=bool(model.get("use_remove_padding", False)), seed=seed)


def optim_config(optim: Any, total_training_steps: int, use_distributed_optimizer: bool = False,
                 clip_grad: float | None = None):
    """verl's ``*.optim`` keys as the engine's OptimConfig. Warm-up as verl: ``lr_warmup_steps`` when >= 0, else
    ``lr_warmup_steps_ratio`` of the total steps; decay over ``lr_decay_steps`` (null: the total steps).
    ``clip_grad``: the FSDP roles' ``grad_clip`` (verl's dp actor/critic key) instead of ``optim.clip_grad``."""
    from verl.engine.megatron.engine import OptimConfig

    total = max(1, total_training_steps)
    warmup = optim.lr_warmup_steps if optim.get("lr_warmup_steps", 0) >= 0 \
        else int(optim.get("lr_warmup_steps_ratio", 0.0) * total)
    return OptimConfig(lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                       betas=tuple(optim.betas),
                       clip_grad=optim.clip_grad if clip_grad is None else clip_grad, lr_warmup_steps=warmup,
                       lr_warmup_init=optim.get("lr_warmup_init", 0.0), total_training_steps=total,
                       lr_decay_steps=optim.get("lr_decay_steps"), lr_decay_style=optim.lr_decay_style,
                       use_distributed_optimizer=use_distributed_optimizer)


def engine_options(megatron: Any, model: Any = None) -> dict[str, Any]:
    """MegatronEngine keyword arguments from a role's verl ``megatron`` section (and the actor's ``model``):
    the params dtype, sequence parallelism and ``override_transformer_config`` (null entries dropped);
    ``model.enable_gradient_checkpointing`` turns on full activation recompute of every layer, as verl's
    Megatron workers do unless the overrides say otherwise."""
    from verl.utils.torch_dtypes import DTYPES

    overrides = {k: v for k, v in dict(megatron.get("override_transformer_config") or {}).items() if v is not None}
    if model is not None and model.get("enable_gradient_checkpointing") and "recompute_granularity" not in overrides:
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {"params_dtype": DTYPES[megatron.get("dtype", "float32")],
            "sequence_parallel": bool(megatron.get("sequence_parallel", False)),
            "transformer_overrides": overrides}


def load_initial_weights(engine: Any, model_path: str, model_config: ModelConfig, head: str) -> None:
    """An HF directory's safetensors into ``engine``; a bare config.json keeps Megatron's seeded init."""
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    if not os.path.isdir(model_path):
        return
    checkpoint = HFCheckpoint(model_path)

    def get_hf(name: str) -> torch.Tensor:
        if name == "score.weight" and head == "value" and name not in checkpoint:
            return torch.zeros(1, model_config.hidden_size)  # an LM checkpoint: the value head starts at zero
        return checkpoint.get(name)

    load_hf_into_model(engine.module, model_config, get_hf, head)

def ppo_mini_batches(data: dict[str, torch.Tensor], mini_batch_size: int, epochs: int, shuffle: bool,
                     seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """``epochs`` passes over ``data`` in mini-batches of ``mini_batch_size`` rows (seeded shuffle)."""
    size = next(iter(data.values())).shape[0]
    for epoch in range(epochs):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle \
            else torch.arange(size)
        for start in range(0, size, mini_batch_size):
            index = order[start:start + mini_batch_size]
            yield {k: v[index] for k, v in data.items()}

def token_budget(section: Any, use_key: str, budget_key: str) -> int | None:
    """verl's dynamic batch size: ``section[budget_key]`` (valid tokens per micro-batch) when
    ``section[use_key]`` is on, else None (micro-batches of a fixed row count)."""
    return int(section[budget_key]) if section.get(use_key) else None


def global_batch_info(response_mask: torch.Tensor, strategy: str = "megatron") -> dict[str, int]:
    """verl's global counts for one mini-batch (this rank's share ``response_mask`` [b, R]): response
    tokens and sequences over every DP rank (one all-reduce) and the DP size. ``agg_loss`` normalises
    each micro-batch's share by them, so the loss is the same for any DP size and micro-batch split."""
    import torch.distributed as dist

    group, size = dp_group_and_size(strategy)
    # On this rank's device: NCCL reduces only CUDA tensors, and the batch may still be on the CPU.
    counts = torch.tensor([int(response_mask.sum()), response_mask.size(0)], dtype=torch.int64,
                          device=get_device())
    dist.all_reduce(counts, group=group)
    return {"dp_size": size, "batch_num_tokens": int(counts[0]), "global_batch_size": int(counts[1])}


def mean_metrics(per_step: list[dict[str, float]]) -> dict[str, float]:
    keys = per_step[0].keys()
    return {k: float(np.mean([m[k] for m in per_step])) for k in keys}

def batch_fields(data: DataProto, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    missing = [k for k in keys if k not in data.batch]
    if missing:
        raise KeyError(f"expected batch fields {missing}, found only {sorted(data.batch.keys())}")
    return {k: data.batch[k] for k in keys}

