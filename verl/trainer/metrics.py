"""Per-step metrics under verl's names, computed on the driver from the step's DataProto.

  critic/score/{mean,max,min}        sequence score (sum of token_level_scores)
  critic/rewards/{mean,max,min}      sequence reward (after the KL penalty, if in the reward)
  critic/advantages/{mean,max,min}   over response tokens
  critic/returns/{mean,max,min}      over response tokens
  critic/values/{mean,max,min}       over response tokens (with a critic)
  critic/vf_explained_var            1 - Var(returns - values) / (Var(returns) + 1e-5) over response
                                     tokens (with a critic; the values the advantages used, as verl)
  response_length/{mean,max,min,clip_ratio}, prompt_length/{mean,max,min,clip_ratio}
  timing_s/<phase>, timing_per_token_ms/<phase>
  perf/total_num_tokens, perf/time_per_step, perf/throughput (tokens / s / rank)
  perf/cpu_memory_used_gb            resident memory of a rank's process (GiB), the max over ranks
  perf/max_memory_{allocated,reserved}_gb   peak device memory (GiB), the max over ranks (GPU only)
  perf/mfu/{actor,critic}            model FLOPs utilisation of the update (GPU with a known peak only;
                                     see verl/utils/flops_counter.py)
  training/global_step, training/epoch
  training/rollout_probs_diff_{max,mean,std}   |p_rollout - p_actor| of the response tokens (verl's
                                     debug metric: the rollout and the actor should agree closely); the
                                     first step of a run fails above the rollout dtype's bound
                                     (rollout_probs_diff_bound)
  training/rollout_log_probs_diff_max   max |log p_rollout - log p_actor| over the response tokens: the same
                                     gap in log-prob space, where a low-precision rollout's rounding shows at
                                     every probability (tests bound it by what the dtype does to the model)
  perf/reshard_bytes, perf/reshard_peak_extra_mb   the colocated 3D-HybridEngine's weight sync
  perf/weight_sync_{bytes,delta_fraction,peak_extra_mb}   a standalone rollout pool's: bytes all training
                                     ranks sent, sent / dense (sparse delta), the senders' scratch
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto
from verl.utils import flops_counter
from verl.utils.device import is_cuda_available


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
        values = batch.batch["values"][response_mask]
        metrics.update(_stats("critic/values", values))
        metrics["critic/vf_explained_var"] = explained_variance(batch.batch["returns"][response_mask], values)
    response_lengths = response_mask.sum(-1).float()
    prompt_lengths = prompt_mask.sum(-1).float()
    metrics.update(_stats("response_length", response_lengths))
    metrics["response_length/clip_ratio"] = (response_lengths == response_length).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_lengths))
    metrics["prompt_length/clip_ratio"] = (prompt_lengths == max_prompt).float().mean().item()
    return metrics


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """verl's ``critic/vf_explained_var``: 1 - Var(returns - values) / (Var(returns) + 1e-5), with
    torch's unbiased variance, over the (already masked) response tokens."""
    returns, values = returns.float(), values.float()
    return (1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)).item()


def compute_rollout_probs_diff_metrics(batch: DataProto) -> dict[str, float]:
    if "rollout_log_probs" not in batch.batch or "old_log_probs" not in batch.batch:
        return {}
    mask = batch.batch["response_mask"].bool()
    log_diff = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask].float()
    diff = (batch.batch["rollout_log_probs"].exp() - batch.batch["old_log_probs"].exp()).abs()[mask].float()
    if diff.numel() == 0:
        return {}
    return {"training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_log_probs_diff_max": log_diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(),
            "training/rollout_probs_diff_std": diff.std(correction=0).item()}


class RolloutMismatchError(RuntimeError):
    """The rollout generated with other weights than the actor's (a broken weight sync): an internal error."""


def rollout_probs_diff_bound(dtype: str) -> float:
    """The largest ``training/rollout_probs_diff_max`` a healthy first step shows for a rollout in ``dtype``:
    2^12 machine epsilons (the rollout's rounding of weights and activations through every layer moves a token's
    probability by a few hundred eps on the models measured), capped at 0.9. float32: 4.9e-4; bfloat16 and
    float16: 0.9, which still catches a rollout with wrong weights, whose worst token the actor all but rules out
    (a difference near 1)."""
    import torch

    from verl.utils.torch_dtypes import torch_dtype

    return min(0.9, 4096 * torch.finfo(torch_dtype(dtype)).eps)


def check_rollout_probs_diff(metrics: dict[str, float], dtype: str) -> None:
    """Raise :class:`RolloutMismatchError` when the step's rollout/actor probability gap exceeds the bound."""
    worst = metrics.get("training/rollout_probs_diff_max")
    bound = rollout_probs_diff_bound(dtype)
    if worst is not None and worst > bound:
        raise RolloutMismatchError(
            f"training/rollout_probs_diff_max={worst:.4g} at the first step: expected at most {bound:.4g} for a "
            f"{dtype} rollout; the rollout's weights are not the actor's (weight sync or layout broken)")


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


GIB = float(2**30)
MEMORY_KEYS = ("perf/cpu_memory_used_gb", "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")


def _resident_bytes() -> int:
    """This process's resident set size now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * 1024 if os.uname().sysname == "Linux" else peak  # KiB on Linux, bytes on macOS


def local_memory_metrics() -> dict[str, float]:
    """This rank's resident memory (GiB) and, on GPU, its peak allocated / reserved device memory (GiB)."""
    out = {"perf/cpu_memory_used_gb": _resident_bytes() / GIB}
    if is_cuda_available():
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / GIB
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / GIB
    return out


def reduce_memory_metrics(per_rank: list[Mapping[str, float]]) -> dict[str, float]:
    """Each key of the ranks' :func:`local_memory_metrics`, the max over ranks, under the same key."""
    keys = dict.fromkeys(k for m in per_rank for k in m)
    return {key: max(m[key] for m in per_rank if key in m) for key in keys}


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """verl's ``reduce_metrics`` of a worker group's ``meta_info["metrics"]`` (one value per DP replica,
    as ``DataProto.concat`` gathers them): the max for names containing "max", the min for "min", else
    the mean. A scalar passes through."""
    out = {}
    for key, values in metrics.items():
        values = np.asarray(values, dtype=np.float64)
        out[key] = float(values.max() if "max" in key else values.min() if "min" in key else values.mean())
    return out


def compute_mfu_metrics(batch: DataProto | list[int], timing: Mapping[str, float], n_devices: int,
                        peak_flops: float | None, actor_config: Any, actor_epochs: int, critic_config: Any = None,
                        critic_epochs: int = 1) -> dict[str, float]:
    """``perf/mfu/actor`` (and ``perf/mfu/critic``) of the step's updates: the FLOPs of ``epochs``
    passes over the batch's valid tokens (verl's formula) / the update phase's seconds / the promised
    FLOP/s of ``n_devices`` devices. Empty without a peak (CPU, or a GPU not in the table)."""
    if peak_flops is None:
        return {}
    # ``batch``: the step's DataProto, or its rows' valid-token counts (the data plane's per-row summary)
    seqlens = list(batch) if isinstance(batch, list) else batch.batch["attention_mask"].sum(-1).tolist()
    out = {}
    for role, config, epochs in (("actor", actor_config, actor_epochs), ("critic", critic_config, critic_epochs)):
        seconds = timing.get(f"update_{role}")
        if config is None or seconds is None:
            continue
        value = flops_counter.mfu(epochs * flops_counter.training_flops(config, seqlens), seconds, n_devices,
                                  peak_flops)
        if value is not None:
            out[f"perf/mfu/{role}"] = value
    return out
