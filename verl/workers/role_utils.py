"""Helpers shared by the roles (actor/rollout/ref, critic, reward model) on any training engine: the
dispatch mesh, PPO mini-batches, global loss counts, batch fields and metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from verl.engine.base import TrainingEngine
from verl.protocol import DataProto
from verl.single_controller import MeshRank
from verl.utils.device import get_device

ACTOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses")


def dp_mesh(engine: TrainingEngine) -> MeshRank:
    """This rank's place in its engine's DP mesh, for dispatch: its replica and whether it returns the output."""
    return MeshRank(engine.dp_rank, engine.dp_size, engine.is_output_rank)


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
    return int(section[budget_key]) if section[use_key] else None


def global_batch_info(response_mask: torch.Tensor, dp_group: Any = None) -> dict[str, int]:
    """verl's global counts for one mini-batch (this rank's share ``response_mask`` [b, R]): response
    tokens and sequences over every rank of ``dp_group`` (the engine's; None: the world; one all-reduce) and
    the DP size. ``agg_loss`` normalises each micro-batch's share by them, so the loss is the same for any
    DP size and micro-batch split."""
    import torch.distributed as dist

    group = dp_group if dp_group is not None else dist.group.WORLD
    size = dist.get_world_size(group=group)
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

