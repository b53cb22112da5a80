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


def rounding_log_prob_gap(model_config: str, dtype: torch.dtype, *, prompt_len: int, response_len: int,
                          rows: int = 64, seed: int = 0, other_seed: int | None = None) -> float:
    """What running a model in ``dtype`` instead of float32 does to its token log-probs: the largest
    |log p_dtype - log p_fp32| over ``rows`` responses of ``response_len`` tokens sampled at temperature 1 (as a
    rollout samples) after random prompts of ``prompt_len`` tokens, for the architecture of ``model_config`` (a
    config.json) at its initialisation scale (``initializer_range``), seeded. Both passes run the same weights;
    the ``dtype`` pass rounds them and every activation to ``dtype`` (bfloat16: 8 significant bits).

    ``other_seed``: instead, the same gap between the float32 model and one with other weights (initialised with
    that seed) -- what a rollout with the wrong weights shows, for a check that a bound would catch it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_config)

    def build(init_seed: int, as_dtype: torch.dtype):
        torch.manual_seed(init_seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(as_dtype).eval()

    reference = build(seed, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (rows, prompt_len), generator=gen)
    with torch.no_grad():
        for _ in range(response_len):
            probs = torch.softmax(reference(ids).logits[:, -1].float(), dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
        other = build(seed if other_seed is None else other_seed, dtype if other_seed is None else torch.float32)

        def log_probs(model) -> torch.Tensor:
            logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[:, prompt_len - 1:-1]
            return logp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1)

        return (log_probs(other) - log_probs(reference)).abs().max().item()
