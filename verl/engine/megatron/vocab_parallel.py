"""Log-probabilities of target tokens and entropy from vocab-parallel logits.

Each TP rank holds logits for its slice of the (padded) vocabulary; the full-vocab tensor is never
built. Three TP all-reduces of [B, S] tensors (max, sum of exp, target logit + sum of p*logit) give
the exact log-softmax statistics. Differentiable: sums go through megatron's
``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), which is the
right gradient because the loss downstream is replicated on every TP rank. Columns at or beyond the
real vocab size (Megatron's padding) are excluded.

Shapes: logits [..., V/tp] (this rank's shard), targets [...] (global token ids).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, compute_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [...], entropy [...] or None), in fp32."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    tp_rank = mpu.get_tensor_model_parallel_rank()
    shard = logits.size(-1)
    start = tp_rank * shard
    logits = logits.float()
    padding = torch.arange(start, start + shard, device=logits.device) >= vocab_size
    if bool(padding.any()):
        logits = logits.masked_fill(padding, torch.finfo(logits.dtype).min)

    # A constant shift leaves log-softmax unchanged, so the max needs no gradient.
    with torch.no_grad():
        shift = logits.max(dim=-1).values
        if mpu.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = logits - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = tp_sum(exp.sum(dim=-1))
    log_z = sum_exp.log()

    local = targets - start
    in_shard = (local >= 0) & (local < shard)
    target_logit = shifted.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = tp_sum(torch.where(in_shard, target_logit, torch.zeros_like(target_logit)))
    log_probs = target_logit - log_z
    if not compute_entropy:
        return log_probs, None
    # H = log Z - E_p[logit]; padded columns have p = 0 (their huge negative logit must not enter).
    weighted = torch.where(padding, torch.zeros_like(shifted), exp * shifted)
    entropy = log_z - tp_sum(weighted.sum(dim=-1)) / sum_exp
    return log_probs, entropy
