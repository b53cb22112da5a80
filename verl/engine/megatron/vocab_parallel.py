"""Log-probabilities of target tokens and entropy from vocab-parallel logits.

Each TP rank holds logits for its slice of the (padded) vocabulary; the full-vocab tensor is never
built. Three TP all-reduces of per-token statistics (max, sum of exp, target logit + sum of p*logit) give
the exact log-softmax statistics. Columns at or beyond the real vocab size (Megatron's padding) are excluded.

Memory: one autograd function that keeps only its input logits and per-token statistics, and works over
``chunk_tokens`` tokens at a time (:data:`CHUNK_ELEMENTS` logits), forward and backward: no fp32 copy of the
shifted logits, their exp or softmax for the whole micro-batch is ever held (with a 49152-token vocabulary
those copies, not the logits, were the largest tensors of the update). The backward recomputes each chunk's
softmax from the saved logits and statistics and writes the gradient chunk by chunk:

    d log p(y) / d z = onehot(y) - p,        d H / d z = -p * (log p + H)

on this rank's vocabulary slice. No TP communication there: the loss downstream is replicated on every TP
rank, so each rank's slice takes its own part of the gradient (what megatron's
``reduce_from_tensor_model_parallel_region`` -- all-reduce forward, identity backward -- gives).

Shapes: logits [..., V/tp] (this rank's shard), targets [...] (global token ids).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Elements of a chunk's fp32 temporaries (64 MiB each): the tokens per chunk follow the vocabulary slice's width,
# 341 tokens of a 49152-token vocabulary, 64 of a 262144-token one (a fixed 1024 tokens held 1 GiB temporaries on
# the latter, more than twice its response logits: results/ has the before and after).
CHUNK_ELEMENTS = 1 << 24


def chunk_tokens_for(shard: int) -> int:
    """Tokens per chunk for a vocabulary slice ``shard`` columns wide."""
    return max(1, CHUNK_ELEMENTS // max(1, shard))


def _tp_group():
    import sys

    mpu = sys.modules.get("megatron.core.parallel_state")  # not imported: no model-parallel group exists
    if mpu is None or not mpu.model_parallel_is_initialized() or mpu.get_tensor_model_parallel_world_size() == 1:
        return None, 0
    return mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank()


class _VocabParallelLogProbs(torch.autograd.Function):
    """(log p(target), entropy) of fp32 logits [N, shard] over the vocabulary split across ``group``."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, compute_entropy, group, tp_rank, chunk_tokens):
        tokens, shard = logits.shape
        start = tp_rank * shard
        padded = start + shard > vocab_size  # this slice has Megatron's padding columns
        valid_columns = min(shard, max(0, vocab_size - start))
        shift = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty_like(shift)
        target_logit = torch.zeros_like(shift)
        weighted = torch.zeros_like(shift) if compute_entropy else None  # sum of exp(z - max) * (z - max)
        local = targets - start
        in_shard = (local >= 0) & (local < valid_columns)
        local = local.clamp(0, shard - 1)

        # The max over every rank's slice first (a constant shift leaves log-softmax unchanged). A slice of
        # padding columns only (a tiny vocabulary at TP > 1) adds nothing: -inf to the max, 0 to the sums.
        shift.fill_(float("-inf"))
        for lo in range(0, tokens if valid_columns else 0, chunk_tokens):
            chunk = logits[lo:lo + chunk_tokens, :valid_columns] if padded else logits[lo:lo + chunk_tokens]
            shift[lo:lo + chunk_tokens] = chunk.max(dim=-1).values
        if group is not None:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
        sum_exp.zero_()
        for lo in range(0, tokens if valid_columns else 0, chunk_tokens):
            hi = min(tokens, lo + chunk_tokens)
            chunk = logits[lo:hi, :valid_columns] if padded else logits[lo:hi]
            shifted = chunk - shift[lo:hi, None]
            target_logit[lo:hi] = torch.where(in_shard[lo:hi], shifted.gather(-1, local[lo:hi, None]).squeeze(-1),
                                              target_logit[lo:hi])
            exp = shifted.exp_()  # in place: ``shifted`` is a temporary of this chunk
            sum_exp[lo:hi] = exp.sum(dim=-1)
            if compute_entropy:
                # exp(z - m) * (z - m) = exp * log(exp); rebuilt from the chunk to stay exact.
                weighted[lo:hi] = (exp * (chunk - shift[lo:hi, None])).sum(dim=-1)
            del shifted, exp
        if group is not None:
            stats = torch.stack([sum_exp, target_logit] + ([weighted] if compute_entropy else []))
            dist.all_reduce(stats, group=group)
            sum_exp, target_logit = stats[0], stats[1]
            weighted = stats[2] if compute_entropy else None
        log_z = sum_exp.log()
        log_probs = target_logit - log_z
        entropy = log_z - weighted / sum_exp if compute_entropy else None
        ctx.save_for_backward(logits, shift, log_z, local, in_shard, entropy)
        ctx.meta = (valid_columns, padded, chunk_tokens, compute_entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, shift, log_z, local, in_shard, entropy = ctx.saved_tensors
        valid_columns, padded, chunk_tokens, compute_entropy = ctx.meta
        tokens = logits.size(0)
        grad = torch.zeros_like(logits) if padded else torch.empty_like(logits)  # padding columns: 0
        use_entropy = compute_entropy and grad_entropy is not None
        for lo in range(0, tokens if valid_columns else 0, chunk_tokens):
            hi = min(tokens, lo + chunk_tokens)
            chunk = logits[lo:hi, :valid_columns] if padded else logits[lo:hi]
            out = grad[lo:hi, :valid_columns] if padded else grad[lo:hi]
            # log softmax on this slice, rounded as torch's: (z - max) - log Z
            log_p = (chunk - shift[lo:hi, None]).sub_(log_z[lo:hi, None])
            p = log_p.exp()
            if grad_log_probs is not None:  # g * (onehot(y) - p)
                g = grad_log_probs[lo:hi]
                torch.mul(p, -g[:, None], out=out)
                rows = torch.nonzero(in_shard[lo:hi]).squeeze(-1)
                out[rows, local[lo:hi][rows]] += g[rows]
            else:
                out.zero_()
            if use_entropy:  # - g_H * p * (log p + H)
                term = log_p.add_(entropy[lo:hi, None]).mul_(p).mul_(grad_entropy[lo:hi, None])
                out.sub_(term)
            del log_p, p
        return grad, None, None, None, None, None, None


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, compute_entropy: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [...], entropy [...] or None), in fp32, over the TP group's vocabulary (one rank's
    slice in ``logits``; no TP group initialised, or TP 1: the whole vocabulary). ``chunk_tokens``: tokens per
    chunk (default: :func:`chunk_tokens_for` the slice's width)."""
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(logits.size(-1))
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: expected >= 1, found {chunk_tokens}")
    group, tp_rank = _tp_group()
    lead = logits.shape[:-1]
    flat = logits.float().reshape(-1, logits.size(-1))
    log_probs, entropy = _VocabParallelLogProbs.apply(flat, targets.reshape(-1), vocab_size, compute_entropy, group,
                                                      tp_rank, chunk_tokens)
    return log_probs.view(lead), entropy.view(lead) if entropy is not None else None
