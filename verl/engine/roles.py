"""verl's actor (and reference policy), critic and reward model over either training engine (Megatron or
FSDP): each role is an engine plus the output function that turns the model's output into its results, and
a loss hook for the update. The engines share one contract (``forward``, ``train_step``,
``token_log_probs``; see :mod:`verl.engine.base`), so these classes serve both.

Batch fields (B samples, S = prompt + response length, R = response length):
  input_ids [B, S], attention_mask [B, S], position_ids [B, S] (optional), responses [B, R];
  anything the loss function needs (old_log_probs, advantages, response_mask, returns, ...).
Outputs:
  actor:         log_probs [B, R] = log p(responses[t] | prefix) under ``logits / temperature``, entropy [B, R]
  critic:        values [B, R] = V(prefix up to the token before each response token) (verl's slicing)
  reward model:  rm_scores [B] = the score head at each sequence's last valid token

``temperature`` (verl's ``logits / temperature``): the distribution the rollout sampled from, so ``log_probs``
recompute the rollout's ``rollout_log_probs``; 1.0 for a greedy rollout (whose log-probs are the raw
log-softmax).
"""

from __future__ import annotations

import contextlib

import torch

from verl.engine.base import Batch, LossFn, TrainingEngine
from verl.engine.lora import adapters_disabled, has_adapters
from verl.engine.micro_batches import response_outputs


def response_values(output, aligned_ids, shifts, micro_batch) -> dict[str, torch.Tensor]:
    return {"values": response_outputs(output.squeeze(-1).float(), shifts, micro_batch)}


def sequence_scores(output, aligned_ids, shifts, micro_batch) -> dict[str, torch.Tensor]:
    last = micro_batch["attention_mask"].sum(dim=1).long() - 1  # rows are left-aligned: valid = [0, n)
    return {"rm_scores": output.squeeze(-1).float().gather(1, last.clamp(min=0)[:, None]).squeeze(1)}


def _expect_head(engine: TrainingEngine, head: str, role: str) -> None:
    if engine.head != head:
        raise ValueError(f"{role}: expected an engine with the {head} head, found {engine.head!r}")


class Actor:
    """verl's actor (or, built on an engine without an optimizer, the reference policy).
    ``max_token_len``: token-budget micro-batches (verl's ``use_dynamic_bsz``), else ``micro_batch_size`` rows.
    ``adapters_off``: the reference policy of a LoRA actor, on the actor's own engine: its forward passes run the
    base model with every adapter disabled (verl's LoRA reference; no second copy of the model)."""

    def __init__(self, engine: TrainingEngine, micro_batch_size: int = 1, max_token_len: int | None = None,
                 adapters_off: bool = False):
        _expect_head(engine, "lm", "actor")
        if adapters_off and not has_adapters(engine.module):
            raise ValueError("reference with adapters off: expected an engine with LoRA adapters, found none")
        self.engine = engine
        self.micro_batch_size = micro_batch_size
        self.max_token_len = max_token_len
        self.adapters_off = adapters_off

    def compute_log_prob(self, batch: Batch, calculate_entropy: bool = True,
                         temperature: float = 1.0) -> dict[str, torch.Tensor]:
        with adapters_disabled(self.engine.module) if self.adapters_off else contextlib.nullcontext():
            return self.engine.forward(batch, self.micro_batch_size,
                                       self.engine.token_log_probs(calculate_entropy, temperature),
                                       max_token_len=self.max_token_len)

    def update_policy(self, batch: Batch, loss_fn: LossFn, calculate_entropy: bool = True,
                      temperature: float = 1.0, **loss_aggregation) -> dict[str, float]:
        """One optimizer step; ``loss_fn({'log_probs', 'entropy'}, micro_batch) -> (loss, metrics)``.
        ``loss_aggregation``: ``global_loss`` / ``summed_metrics`` of the engine's ``train_step``."""
        return self.engine.train_step(batch, self.micro_batch_size,
                                      self.engine.token_log_probs(calculate_entropy, temperature), loss_fn,
                                      max_token_len=self.max_token_len, **loss_aggregation)


class Critic:
    """``forward_max_token_len`` / ``max_token_len``: token-budget micro-batches for values / updates
    (verl's ``use_dynamic_bsz``), else ``micro_batch_size`` rows."""

    def __init__(self, engine: TrainingEngine, micro_batch_size: int = 1, max_token_len: int | None = None,
                 forward_max_token_len: int | None = None):
        _expect_head(engine, "value", "critic")
        self.engine = engine
        self.micro_batch_size = micro_batch_size
        self.max_token_len = max_token_len
        self.forward_max_token_len = forward_max_token_len

    def compute_values(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.engine.forward(batch, self.micro_batch_size, response_values,
                                   max_token_len=self.forward_max_token_len)

    def update_critic(self, batch: Batch, loss_fn: LossFn, **loss_aggregation) -> dict[str, float]:
        """One optimizer step; ``loss_fn({'values'}, micro_batch) -> (loss, metrics)``."""
        return self.engine.train_step(batch, self.micro_batch_size, response_values, loss_fn,
                                      max_token_len=self.max_token_len, **loss_aggregation)


class RewardModel:
    def __init__(self, engine: TrainingEngine, micro_batch_size: int = 1):
        _expect_head(engine, "score", "reward model")
        self.engine = engine
        self.micro_batch_size = micro_batch_size

    def compute_rm_score(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.engine.forward(batch, self.micro_batch_size, sequence_scores)
