"""Actor / reference policy on megatron-core: response log-probs, entropy, policy updates.

Batch fields (B samples, S = prompt + response length, R = response length):
  input_ids [B, S], attention_mask [B, S], position_ids [B, S] (optional), responses [B, R];
  anything the loss function needs (old_log_probs, advantages, response_mask, ...).
Outputs: log_probs [B, R] = log p(responses[t] | prefix), entropy [B, R] (fp32).

``temperature`` (verl's ``logits / temperature``): the distribution the rollout sampled from, so
``log_probs`` recompute the rollout's ``rollout_log_probs``; 1.0 for a greedy rollout (whose
log-probs are the raw log-softmax).
"""

from __future__ import annotations

import torch

from verl.engine.megatron.engine import Batch, LossFn, MegatronEngine
from verl.engine.megatron.padding import restore
from verl.engine.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy


def token_log_probs(engine: MegatronEngine, compute_entropy: bool, temperature: float = 1.0):
    """output_fn: log p(token t+1 | tokens <= t) under ``logits / temperature`` for every position,
    sliced to the response."""
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0 (use 1.0 for a greedy rollout), found {temperature}")

    def output_fn(logits, aligned_ids, shifts, micro_batch) -> dict[str, torch.Tensor]:
        response_length = micro_batch["responses"].size(1)
        if temperature != 1.0:
            logits = logits / temperature  # out of place: the logits are part of the autograd graph
        # Next-token targets in the left-aligned rows; the last column wraps onto padding.
        targets = torch.roll(aligned_ids, shifts=-1, dims=1)
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            logits, targets, engine.config.vocab_size, compute_entropy)
        outputs = {"log_probs": restore(log_probs, shifts)[:, -response_length - 1:-1]}
        if entropy is not None:
            outputs["entropy"] = restore(entropy, shifts)[:, -response_length - 1:-1]
        return outputs

    return output_fn


class MegatronActor:
    """verl's actor (or, built without an optimizer, the reference policy)."""

    def __init__(self, engine: MegatronEngine, micro_batch_size: int = 1, max_token_len: int | None = None):
        if engine.head != "lm":
            raise ValueError(f"actor: expected an engine with the lm head, found {engine.head!r}")
        self.engine = engine
        self.micro_batch_size = micro_batch_size
        self.max_token_len = max_token_len  # set: token-budget micro-batches (verl's use_dynamic_bsz)

    def compute_log_prob(self, batch: Batch, calculate_entropy: bool = True,
                         temperature: float = 1.0) -> dict[str, torch.Tensor]:
        return self.engine.forward(batch, self.micro_batch_size,
                                   token_log_probs(self.engine, calculate_entropy, temperature),
                                   max_token_len=self.max_token_len)

    def update_policy(self, batch: Batch, loss_fn: LossFn, calculate_entropy: bool = True,
                      temperature: float = 1.0, **loss_aggregation) -> dict[str, float]:
        """One optimizer step; ``loss_fn({'log_probs', 'entropy'}, micro_batch) -> (loss, metrics)``.
        ``loss_aggregation``: ``global_loss`` / ``summed_metrics`` of :meth:`MegatronEngine.train_step`."""
        return self.engine.train_step(batch, self.micro_batch_size,
                                      token_log_probs(self.engine, calculate_entropy, temperature), loss_fn,
                                      max_token_len=self.max_token_len, **loss_aggregation)
