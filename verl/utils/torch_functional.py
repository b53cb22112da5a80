"""Masked tensor statistics and logit helpers shared by the RL losses.

Shapes: ``B`` = batch size, ``R`` = response length, ``V`` = vocabulary size.
Masks are 0/1 (bool or integer) tensors broadcastable to the values.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over all elements, or along ``axis``)."""
    return (values * mask).sum(dim=axis) if axis is not None else (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; the 1e-8 keeps an all-zero mask finite (result 0)."""
    return masked_sum(values, mask, axis) / (masked_sum(torch.ones_like(values), mask, axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements; ``unbiased`` applies Bessel's correction n/(n-1)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: expected at least one unmasked element, found an all-zero mask")
        if count == 1:
            raise ValueError("masked_var: expected at least two unmasked elements for an unbiased variance, found 1")
        variance = variance * count / (count - 1)
    return variance


def whiten_statistics(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(count, sum, sum of squares) of the masked elements, in float64: the sufficient statistics of
    :func:`masked_whiten`, which add up over shards (the data plane whitens a sharded batch from their sum)."""
    m = mask.to(torch.float64)
    v = values.to(torch.float64)
    return torch.stack([m.sum(), (v * m).sum(), (v * v * m).sum()])


def whiten_with(values: torch.Tensor, statistics: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``values`` whitened with the mean and unbiased variance that ``statistics`` (:func:`whiten_statistics`,
    possibly summed over shards) give. The statistics stay in float64 until one rounding to ``values``' dtype,
    so a batch whitened whole and the same batch whitened from its shards' summed statistics agree bit for bit
    unless a float64 difference of their summation orders (~1e-16 relative) straddles a rounding boundary."""
    count, total, squares = statistics.tolist()
    if count < 2:
        raise ValueError(f"masked_whiten: expected at least two unmasked elements for an unbiased variance, "
                         f"found {int(count)}")
    mean = total / count
    var = max(squares - count * mean * mean, 0.0) / (count - 1)
    whitened = (values - mean) * torch.rsqrt(torch.tensor(var + 1e-8, dtype=values.dtype))
    return whitened if shift_mean else whitened + mean


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over masked elements (unbiased variance, verl's masked_whiten);
    keeps the mean if not ``shift_mean``."""
    return whiten_with(values, whiten_statistics(values, mask), shift_mean)


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise clamp of ``x`` into [tensor_min, tensor_max] (tensor bounds)."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...].

    Uses H = logsumexp(z) - sum(softmax(z) * z), which avoids log(0) for tiny probabilities.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
