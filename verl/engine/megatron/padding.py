"""megatron GPTModel's attention mask for a left-aligned batch (:mod:`verl.engine.padding`)."""

from __future__ import annotations

import torch


def attention_mask_4d(aligned_mask: torch.Tensor) -> torch.Tensor:
    """megatron's boolean mask [B, 1, S, S]: True where attention is forbidden (future or pad key)."""
    seq = aligned_mask.size(1)
    future = torch.ones(seq, seq, dtype=torch.bool, device=aligned_mask.device).triu(1)
    pad_key = ~aligned_mask.bool()[:, None, None, :]
    return future[None, None] | pad_key
