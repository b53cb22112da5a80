"""Next-token choice from full-vocabulary logits: greedy, or temperature + top-k + top-p sampling.

The returned log-probability is ``log_softmax(logits / temperature)`` at the chosen token, over the
whole vocabulary and before top-k/top-p truncation (verl's ``rollout_log_probs``, which the actor
recomputes the same way); greedy uses temperature 1. All rows are handled by one set of batched ops.
"""

from __future__ import annotations

import torch

from verl.engine.rollout.base import SamplingParams


def truncation_mask(scaled_logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """Bool [B, V], True where a token is excluded by top-k then top-p; None when nothing is excluded.

    top-k keeps every token at least as likely as the k-th (ties included); top-p keeps the most
    likely tokens until their cumulative probability reaches ``top_p`` (the first always kept).
    """
    vocab = scaled_logits.shape[-1]
    excluded = None
    if 0 < top_k < vocab:
        kth = torch.topk(scaled_logits, top_k, dim=-1).values[:, -1:]
        excluded = scaled_logits < kth
    if top_p < 1.0:
        logits = scaled_logits if excluded is None else scaled_logits.masked_fill(excluded, float("-inf"))
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_excluded = mass_before >= top_p
        by_top_p = torch.empty_like(sorted_excluded).scatter_(-1, order, sorted_excluded)
        excluded = by_top_p if excluded is None else excluded | by_top_p
    return excluded


def inverse_cdf_draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of probs [B, V]: the first token whose cumulative probability exceeds u*total.

    One uniform per row (torch.multinomial spends far more). In float64, u < 1 keeps u*total below
    the last cumulative value, and a zero-probability token never opens an interval of its own.
    """
    cdf = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype) -> (token ids [B] int64, their log-probabilities [B] float32)."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
        log_probs = logits.log_softmax(-1)
    else:
        scaled = logits / params.temperature if params.temperature != 1.0 else logits
        log_probs = scaled.log_softmax(-1)
        excluded = truncation_mask(scaled, params.top_k, params.top_p)
        probs = log_probs.exp() if excluded is None else scaled.masked_fill(excluded, float("-inf")).softmax(-1)
        tokens = inverse_cdf_draw(probs, generator)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
