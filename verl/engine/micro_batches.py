"""Micro-batches of a padded RL batch, shared by the training engines (Megatron, FSDP): fixed row counts,
or verl's dynamic batch size (``use_dynamic_bsz``: rows grouped under a token budget)."""

from __future__ import annotations

import torch

from verl.engine.base import Batch
from verl.engine.padding import restore
from verl.errors import InputError


def split_micro_batches(batch: Batch, micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    sizes = {k: v.size(0) for k, v in batch.items()}
    size = next(iter(sizes.values()))
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch: expected one batch size for every field, found {sizes}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: expected >= 1, found {micro_batch_size}")
    # verl's split: micro-batches of micro_batch_size rows, the last one shorter when it does not divide the batch,
    # one micro-batch when it is at least the batch.
    return [{k: v[i:i + micro_batch_size] for k, v in batch.items()} for i in range(0, size, micro_batch_size)]


def token_budget_groups(attention_mask: torch.Tensor, max_token_len: int) -> list[list[int]]:
    """verl's dynamic batch size (``use_dynamic_bsz``): the rows [B] of a batch in micro-batches whose
    valid tokens (``attention_mask.sum(-1)``) add up to at most ``max_token_len`` (first-fit decreasing:
    longest rows first, each into the first micro-batch with room). Each group lists its rows ascending;
    groups are ordered by their first row."""
    lengths = attention_mask.sum(dim=-1).tolist()
    longest = max(lengths, default=0)
    if longest > max_token_len:
        raise InputError(f"max_token_len: expected at least the longest sequence in the batch ({longest} tokens), "
                         f"found {max_token_len}")
    groups: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, free in enumerate(room):
            if lengths[row] <= free:
                groups[g].append(row)
                room[g] -= lengths[row]
                break
        else:
            groups.append([row])
            room.append(max_token_len - lengths[row])
    return sorted(sorted(group) for group in groups)


def response_outputs(per_position: torch.Tensor, shifts: torch.Tensor, micro_batch: Batch) -> torch.Tensor:
    """A per-position output of left-aligned rows ([B, S]: log-probs, entropy, values) back in the batch's
    layout and cut to the response ([B, R]: position t scores token t + 1), with 0 where the response is
    padding. Pad positions are never read by the losses, but an engine that skips padded columns would
    otherwise leave them depending on which rows shared a micro-batch; 0 (verl's remove-padding convention)
    keeps every output a function of its own row."""
    response_length = micro_batch["responses"].size(1)
    per_token = restore(per_position, shifts)[:, -response_length - 1:-1]
    valid = micro_batch["attention_mask"][:, -response_length:].bool()
    return per_token.masked_fill(~valid, 0.0)
