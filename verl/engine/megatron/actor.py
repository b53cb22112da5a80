"""The Megatron engine's log-prob output function (``MegatronEngine.token_log_probs``; the actor is
:class:`verl.engine.roles.Actor`): response log-probs and entropy from vocab-parallel logits.

``temperature`` (verl's ``logits / temperature``): the distribution the rollout sampled from, so
``log_probs`` recompute the rollout's ``rollout_log_probs``; 1.0 for a greedy rollout (whose
log-probs are the raw log-softmax).

The output function carries ``response_fn``: the engine then runs the output layer on the response
positions only and hands it their logits (prompt columns never reach the vocabulary), with the same results.
"""

from __future__ import annotations

import torch

from verl.engine.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy
from verl.engine.micro_batches import response_outputs


def token_log_probs(engine, compute_entropy: bool, temperature: float = 1.0):
    """output_fn: log p(token t+1 | tokens <= t) under ``logits / temperature`` for every position,
    sliced to the response."""
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0 (use 1.0 for a greedy rollout), found {temperature}")

    def output_fn(logits, aligned_ids, shifts, micro_batch) -> dict[str, torch.Tensor]:
        if temperature != 1.0:
            logits = logits / temperature  # out of place: the logits are part of the autograd graph
        # Next-token targets in the left-aligned rows; the last column wraps onto padding.
        targets = torch.roll(aligned_ids, shifts=-1, dims=1)
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            logits, targets, engine.config.vocab_size, compute_entropy)
        outputs = {"log_probs": response_outputs(log_probs, shifts, micro_batch)}
        if entropy is not None:
            outputs["entropy"] = response_outputs(entropy, shifts, micro_batch)
        return outputs

    def response_fn(logits, micro_batch) -> dict[str, torch.Tensor]:
        """The same outputs from the logits of the response positions alone ([b, R, V/tp]: position j scores
        response token j; the engine ran the output layer there only)."""
        if temperature != 1.0:
            logits = logits / temperature
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            logits, micro_batch["responses"], engine.config.vocab_size, compute_entropy)
        valid = micro_batch["attention_mask"][:, -log_probs.size(1):].bool()
        outputs = {"log_probs": log_probs.masked_fill(~valid, 0.0)}
        if entropy is not None:
            outputs["entropy"] = entropy.masked_fill(~valid, 0.0)
        return outputs

    output_fn.response_fn = response_fn
    return output_fn
