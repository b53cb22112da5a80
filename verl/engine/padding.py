"""Padded RL batches -> left-aligned model inputs, and back (both training engines).

megatron's RoPE uses a token's index in the sequence as its position (``position_ids`` only feed
learned absolute embeddings), so left padding would shift every position. Each row is therefore
rotated so its valid tokens start at index 0 (right padding: causal attention keeps the trailing
pads out of every valid token's context), and outputs are rotated back. The FSDP engine hands its
``output_fn`` the same left-aligned rows, so a role's output functions serve either backend.

Shapes: B = batch, S = sequence length. ``attention_mask`` is 1 on valid tokens, which must be one
contiguous run per row (left and/or right padding, as verl batches are).
"""

from __future__ import annotations

import torch


class BatchLayoutError(ValueError):
    """A batch whose padding a left-aligned run of positions cannot represent."""


def left_align(input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [B,S], attention_mask [B,S], shifts [B]) with valid tokens moved to the front."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise BatchLayoutError(f"input_ids / attention_mask: expected equal [B, S] shapes, "
                               f"found {tuple(input_ids.shape)} / {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    shifts = mask.int().argmax(dim=1)  # index of the first valid token (0 for an all-pad row)
    seq = torch.arange(input_ids.size(1), device=input_ids.device)
    expected = (seq >= shifts[:, None]) & (seq < (shifts + lengths)[:, None])
    if not torch.equal(mask, expected):
        row = int((mask != expected).any(dim=1).nonzero()[0])
        raise BatchLayoutError(f"attention_mask row {row}: expected one contiguous run of 1s, found "
                               f"{attention_mask[row].tolist()}")
    if position_ids is not None:
        valid_positions = torch.where(mask, position_ids, torch.zeros_like(position_ids))
        wanted = torch.where(mask, seq[None, :] - shifts[:, None], torch.zeros_like(position_ids))
        if not torch.equal(valid_positions, wanted):
            row = int((valid_positions != wanted).any(dim=1).nonzero()[0])
            raise BatchLayoutError(f"position_ids row {row}: expected 0..n-1 on the valid tokens, found "
                                   f"{position_ids[row][mask[row]].tolist()}")
    return rotate(input_ids, shifts), rotate(attention_mask, shifts), shifts


def rotate(tensor: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Row b of ``tensor`` [B, S, ...] rotated left by shifts[b] (negative shifts rotate right)."""
    seq = tensor.size(1)
    index = (torch.arange(seq, device=tensor.device)[None, :] + shifts[:, None]) % seq
    index = index.view(index.shape + (1,) * (tensor.dim() - 2)).expand_as(tensor)
    return tensor.gather(1, index)


def restore(tensor: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`left_align`'s rotation for a [B, S, ...] output."""
    return rotate(tensor, -shifts)
