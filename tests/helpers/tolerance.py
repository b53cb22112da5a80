"""Comparison tolerances derived from the dtype and the size of the reductions, not read off one machine.

Two computations of the same value that differ only in how their floating-point sums are ordered (another
kernel, another sharding, another number of ranks, another CPU's vector width) may differ. For a sum of n
terms each order's rounding error is at most (n - 1) * u * sum|x_i|, u = eps / 2 (Higham, *Accuracy and
Stability of Numerical Algorithms*, eq. 4.4), so two orders differ by at most (n - 1) * eps * sum|x_i|.
A forward pass chains ``depth`` such reductions; to first order their relative errors add. These are worst
cases: typical differences are 10-100x smaller, while a layout bug (a wrong shard, a wrong row, a missing
bias) moves an output by its own magnitude, far above them.
"""

from __future__ import annotations

import torch


def reordered_sum_tolerance(dtype: torch.dtype, terms: int, abs_sum: float) -> float:
    """Largest difference between two orders of a sum of ``terms`` values whose magnitudes add to ``abs_sum``."""
    return max(terms - 1, 1) * torch.finfo(dtype).eps * abs_sum


def decoder_depth(num_layers: int) -> int:
    """Chained reductions of a pre-norm decoder: per layer two RMSNorms, q/k/v, the scores, the weighted sum of
    values, o_proj, the MLP's two projections (8); then the final norm and the LM head (or value head)."""
    return 8 * num_layers + 2


def forward_tolerance(dtype: torch.dtype, *, width: int, depth: int, scale: float = 1.0) -> float:
    """Bound on |a - b| for two evaluations of one network whose widest reduction has ``width`` terms, with
    ``depth`` reductions chained, and activations of magnitude ``scale`` feeding them.

    In a pre-norm transformer every projection reads RMS-normalised activations (unit RMS), so the magnitude
    that the rounding is relative to is at least 1 even where the outputs are smaller: callers pass
    ``max(1, |output|)``.
    """
    return reordered_sum_tolerance(dtype, width + 1, scale) * depth


def logits_tolerance(dtype: torch.dtype, *, width: int, num_layers: int, scale: float = 1.0) -> float:
    """Logits (or a value/score head) of a ``num_layers`` pre-norm decoder whose widest reduction has ``width``
    terms, against another implementation with the same weights (``scale``: max(1, |logits|))."""
    return forward_tolerance(dtype, width=width, depth=decoder_depth(num_layers), scale=scale)


def log_prob_tolerance(dtype: torch.dtype, *, width: int, num_layers: int, vocab: int, scale: float = 1.0) -> float:
    """Token log-probs: those logits through a log-softmax, one more reduction over ``vocab`` terms."""
    return logits_tolerance(dtype, width=width, num_layers=num_layers, scale=scale) + forward_tolerance(
        dtype, width=vocab, depth=1, scale=scale)
