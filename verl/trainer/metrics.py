"""Per-step metrics under verl's names, computed on the driver from the step's DataProto.

  critic/score/{mean,max,min}        sequence score (sum of token_level_scores)
  critic/rewards/{mean,max,min}      sequence reward (after the KL penalty, if in the reward)
  critic/advantages/{mean,max,min}   over response tokens
  critic/returns/{mean,max,min}      over response tokens
  critic/values/{mean,max,min}       over response tokens (with a critic)
  response_length/{mean,max,min,clip_ratio}, prompt_length/{mean,max,min,clip_ratio}
  timing_s/<phase>, timing_per_token_ms/<phase>
  perf/total_num_tokens, perf/time_per_step, perf/throughput (tokens / s / rank)
  perf/rss_mb/{max,min}              resident memory over ranks (CPU), perf/max_memory_allocated_gb (GPU)
  training/rollout_probs_diff_{max,mean,std}   |p_rollout - p_actor| of the response tokens (verl's
                                     debug metric: the rollout and the actor should agree closely)
"""

from __future__ import annotations

import resource

import torch

from verl.protocol import DataProto


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def compute_data_metrics(batch: DataProto, use_critic: bool) -> dict[str, float]:
    response_length = batch.batch["responses"].shape[-1]
    response_mask = batch.batch["response_mask"].bool()
    prompt_mask = batch.batch["attention_mask"][:, :-response_length].bool()
    max_prompt = prompt_mask.shape[-1]
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", batch.batch["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)))
    metrics.update(_stats("critic/advantages", batch.batch["advantages"][response_mask]))
    metrics.update(_stats("critic/returns", batch.batch["returns"][response_mask]))
    if use_critic:
        metrics.update(_stats("critic/values", batch.batch["values"][response_mask]))
    response_lengths = response_mask.sum(-1).float()
    prompt_lengths = prompt_mask.sum(-1).float()
    metrics.update(_stats("response_length", response_lengths))
    metrics["response_length/clip_ratio"] = (response_lengths == response_length).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_lengths))
    metrics["prompt_length/clip_ratio"] = (prompt_lengths == max_prompt).float().mean().item()
    return metrics


def compute_rollout_probs_diff_metrics(batch: DataProto) -> dict[str, float]:
    if "rollout_log_probs" not in batch.batch or "old_log_probs" not in batch.batch:
        return {}
    mask = batch.batch["response_mask"].bool()
    diff = (batch.batch["rollout_log_probs"].exp() - batch.batch["old_log_probs"].exp()).abs()[mask].float()
    if diff.numel() == 0:
        return {}
    return {"training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(),
            "training/rollout_probs_diff_std": diff.std(correction=0).item()}


def compute_timing_metrics(batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
    """timing_s/<phase> and, for the phases that touch every token, milliseconds per token."""
    response_tokens = int(batch.batch["response_mask"].sum())
    all_tokens = int(batch.batch["attention_mask"].sum())
    per_phase_tokens = {"gen": response_tokens, **{k: all_tokens for k in ("ref", "values", "adv", "update_critic",
                                                                          "update_actor", "old_log_prob")}}
    out = {f"timing_s/{name}": seconds for name, seconds in timing.items()}
    for name, tokens in per_phase_tokens.items():
        if name in timing and tokens:
            out[f"timing_per_token_ms/{name}"] = timing[name] * 1000.0 / tokens
    return out


def compute_throughput_metrics(batch: DataProto, step_seconds: float, n_ranks: int) -> dict[str, float]:
    tokens = int(batch.batch["attention_mask"].sum())
    return {"perf/total_num_tokens": float(tokens), "perf/time_per_step": step_seconds,
            "perf/throughput": tokens / max(step_seconds, 1e-9) / n_ranks}


def local_memory_metrics() -> dict[str, float]:
    """This rank's peak resident memory (MiB) and, on GPU, peak allocated device memory (GiB)."""
    out = {"perf/rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    if torch.cuda.is_available():
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def reduce_memory_metrics(per_rank: list) -> dict[str, float]:
    """Max/min over ranks of each rank's :func:`local_memory_metrics`, plus the per-rank RSS."""
    out: dict[str, float] = {}
    for key in per_rank[0]:
        values = [m[key] for m in per_rank]
        out[f"{key}/max"] = max(values)
        out[f"{key}/min"] = min(values)
    for rank, m in enumerate(per_rank):
        out[f"perf/rss_mb/rank{rank}"] = m["perf/rss_mb"]
    return out
