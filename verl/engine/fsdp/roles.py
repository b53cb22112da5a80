"""Actor / reference, critic and reward model on the FSDP engine: the same methods as the Megatron ones
(:mod:`verl.engine.megatron.actor`, :mod:`verl.engine.megatron.critic`), with full-vocabulary logits.

Outputs: log_probs [B, R] = log p(responses[t] | prefix) under ``logits / temperature`` and entropy [B, R]
(fp32); values [B, R]; rm_scores [B].
"""

from __future__ import annotations

import torch

from verl.engine.fsdp.engine import FSDPEngine
from verl.engine.megatron.critic import response_values, sequence_scores
from verl.engine.megatron.engine import Batch, LossFn
from verl.engine.megatron.padding import restore


def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor,
                          compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [...], entropy [...] or None) in fp32 from full-vocabulary logits [..., V]."""
    log_z = torch.logsumexp(logits.float(), dim=-1)
    target_logit = logits.float().gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    log_probs = target_logit - log_z
    if not compute_entropy:
        return log_probs, None
    probs = torch.softmax(logits.float(), dim=-1)
    entropy = log_z - (probs * logits.float()).sum(dim=-1)
    return log_probs, entropy


def token_log_probs(compute_entropy: bool, temperature: float = 1.0):
    """output_fn: log p(token t+1 | tokens <= t) under ``logits / temperature``, sliced to the response."""
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0 (use 1.0 for a greedy rollout), found {temperature}")

    def output_fn(logits, aligned_ids, shifts, micro_batch) -> dict[str, torch.Tensor]:
        response_length = micro_batch["responses"].size(1)
        if temperature != 1.0:
            logits = logits / temperature
        targets = torch.roll(aligned_ids, shifts=-1, dims=1)  # the last column wraps onto padding
        log_probs, entropy = log_probs_and_entropy(logits, targets, compute_entropy)
        outputs = {"log_probs": restore(log_probs, shifts)[:, -response_length - 1:-1]}
        if entropy is not None:
            outputs["entropy"] = restore(entropy, shifts)[:, -response_length - 1:-1]
        return outputs

    return output_fn


class FSDPActor:
    """verl's dp actor (or, built without an optimizer, the reference policy)."""

    def __init__(self, engine: FSDPEngine, micro_batch_size: int = 1, max_token_len: int | None = None):
        if engine.head != "lm":
            raise ValueError(f"actor: expected an engine with the lm head, found {engine.head!r}")
        self.engine = engine
        self.micro_batch_size = micro_batch_size
        self.max_token_len = max_token_len

    def compute_log_prob(self, batch: Batch, calculate_entropy: bool = True,
                         temperature: float = 1.0) -> dict[str, torch.Tensor]:
        return self.engine.forward(batch, self.micro_batch_size, token_log_probs(calculate_entropy, temperature),
                                   max_token_len=self.max_token_len)

    def update_policy(self, batch: Batch, loss_fn: LossFn, calculate_entropy: bool = True,
                      temperature: float = 1.0, **loss_aggregation) -> dict[str, float]:
        return self.engine.train_step(batch, self.micro_batch_size, token_log_probs(calculate_entropy, temperature),
                                      loss_fn, max_token_len=self.max_token_len, **loss_aggregation)


class FSDPCritic:
    def __init__(self, engine: FSDPEngine, micro_batch_size: int = 1, max_token_len: int | None = None,
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
        return self.engine.train_step(batch, self.micro_batch_size, response_values, loss_fn,
                                      max_token_len=self.max_token_len, **loss_aggregation)


class FSDPRewardModel:
    def __init__(self, engine: FSDPEngine, micro_batch_size: int = 1):
        if engine.head != "score":
            raise ValueError(f"reward model: expected an engine with the score head, found {engine.head!r}")
        self.engine = engine
        self.micro_batch_size = micro_batch_size

    def compute_rm_score(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.engine.forward(batch, self.micro_batch_size, sequence_scores)
