"""Critic (per-token values) and reward model (one score per sequence) on megatron-core.

Batch fields as for the actor (input_ids, attention_mask, position_ids, responses [B, R]).
  critic:        values [B, R] = V(prefix up to the token before each response token) (verl's slicing)
  reward model:  rm_scores [B] = the score head at each sequence's last valid token
"""

from __future__ import annotations

import torch

from verl.engine.megatron.engine import Batch, LossFn, MegatronEngine
from verl.engine.megatron.padding import restore


def response_values(output, aligned_ids, shifts, micro_batch) -> dict[str, torch.Tensor]:
    response_length = micro_batch["responses"].size(1)
    values = restore(output.squeeze(-1).float(), shifts)
    return {"values": values[:, -response_length - 1:-1]}


def sequence_scores(output, aligned_ids, shifts, micro_batch) -> dict[str, torch.Tensor]:
    last = micro_batch["attention_mask"].sum(dim=1).long() - 1  # rows are left-aligned: valid = [0, n)
    return {"rm_scores": output.squeeze(-1).float().gather(1, last.clamp(min=0)[:, None]).squeeze(1)}


class MegatronCritic:
    """``forward_max_token_len`` / ``max_token_len``: token-budget micro-batches for values / updates
    (verl's ``use_dynamic_bsz``), else ``micro_batch_size`` rows."""

    def __init__(self, engine: MegatronEngine, micro_batch_size: int = 1, max_token_len: int | None = None,
                 forward_max_token_len: int | None = None):
        if engine.head != "value":
            raise ValueError(f"critic: expected an engine with the value head, found {engine.head!r}")
        self.engine = engine
        self.micro_batch_size = micro_batch_size
        self.max_token_len = max_token_len
        self.forward_max_token_len = forward_max_token_len

    def compute_values(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.engine.forward(batch, self.micro_batch_size, response_values,
                                   max_token_len=self.forward_max_token_len)

    def update_critic(self, batch: Batch, loss_fn: LossFn, **loss_aggregation) -> dict[str, float]:
        """One optimizer step; ``loss_fn({'values'}, micro_batch) -> (loss, metrics)``.
        ``loss_aggregation``: ``global_loss`` / ``summed_metrics`` of :meth:`MegatronEngine.train_step`."""
        return self.engine.train_step(batch, self.micro_batch_size, response_values, loss_fn,
                                      max_token_len=self.max_token_len, **loss_aggregation)


class MegatronRewardModel:
    def __init__(self, engine: MegatronEngine, micro_batch_size: int = 1):
        if engine.head != "score":
            raise ValueError(f"reward model: expected an engine with the score head, found {engine.head!r}")
        self.engine = engine
        self.micro_batch_size = micro_batch_size

    def compute_rm_score(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.engine.forward(batch, self.micro_batch_size, sequence_scores)
