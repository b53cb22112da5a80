"""The FSDP engine's log-prob output function (``FSDPEngine.token_log_probs``; the actor is
:class:`verl.engine.roles.Actor`): response log-probs under ``logits / temperature`` and entropy, fp32, from
full-vocabulary logits.
"""

from __future__ import annotations

import torch

from verl.engine.micro_batches import response_outputs


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
        if temperature != 1.0:
            logits = logits / temperature
        targets = torch.roll(aligned_ids, shifts=-1, dims=1)  # the last column wraps onto padding
        log_probs, entropy = log_probs_and_entropy(logits, targets, compute_entropy)
        outputs = {"log_probs": response_outputs(log_probs, shifts, micro_batch)}
        if entropy is not None:
            outputs["entropy"] = response_outputs(entropy, shifts, micro_batch)
        return outputs

    return output_fn
