"""The controller's operations on a step's batch, the same on both data paths.

On the legacy path the batch is a :class:`~verl.protocol.DataProto` every rank holds whole; on the data plane
(``transfer_queue.enable=true``) it is a :class:`~verl.single_controller.data_plane.ShardedBatch` whose rows
stay where they were produced. The PPO script in ``trainer.py`` calls these functions and reads the same on
both:

- :func:`add_fields`: new per-row fields computed from a row's own fields (rewards, the KL penalty, an
  alias); on the data plane each holder computes its rows in place;
- :func:`per_row`: a small per-row result on every rank (lengths for balancing, metric summaries);
- :func:`compute_advantages`: the advantage estimator; on the data plane on each holder's rows (GRPO-style
  groups are whole on the rollout replica that sampled them), with batch-wide whitening (GAE, REINFORCE++)
  from global sums: two passes and one all-reduce;
- :func:`step_metrics`: verl's data metrics from per-row summaries (sums, counts, extremes) on the data
  plane; the legacy path keeps its own full-tensor code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import verl.utils.torch_functional as verl_F
from verl.protocol import DataProto
from verl.single_controller.data_plane import ColumnGroup, ShardedBatch, all_gather_small, object_group
from verl.trainer import metrics as metric_utils
from verl.trainer.ppo.advantage import compute_advantage, compute_response_mask

Batch = DataProto | ShardedBatch
ANCHOR = "responses"  # the rollout's output: where a step's rows live on the data plane


def add_fields(batch: Batch, fn: Callable[[DataProto], Mapping[str, torch.Tensor]], inputs: Iterable[str],
               anchor: str = ANCHOR) -> Batch:
    """``fn(rows) -> {name: [rows, ...]}`` added to ``batch`` (in place; returned)."""
    if isinstance(batch, ShardedBatch):
        return batch.union(batch.map_rows(fn, list(inputs), anchor))
    for name, value in fn(batch).items():
        batch.batch[name] = value
    return batch


def per_row(batch: Batch, fn: Callable[[DataProto], torch.Tensor], inputs: Iterable[str],
            anchor: str = ANCHOR) -> torch.Tensor:
    """``fn(rows) -> [rows, ...]`` for every row, on every rank, in batch order."""
    if isinstance(batch, ShardedBatch):
        return batch.row_values(fn, list(inputs), anchor)
    return fn(batch)


def add_replicated(batch: Batch, fields: Mapping[str, torch.Tensor]) -> Batch:
    """Small per-row fields every rank computed whole (e.g. ReMax's baselines), added to ``batch``."""
    if isinstance(batch, ShardedBatch):
        rank = dist.get_rank() if dist.is_initialized() else 0
        return batch.union(ShardedBatch(len(batch), [ColumnGroup.replicate(dict(fields), len(batch), rank)]))
    for name, value in fields.items():
        batch.batch[name] = value
    return batch


def pop_fields(batch: Batch, names: Iterable[str]) -> None:
    if isinstance(batch, ShardedBatch):
        batch.pop(names)
    else:
        for name in names:
            batch.batch.pop(name)


def gather_to_rank0(batch: Batch, fields: Iterable[str] | None = None) -> DataProto | None:
    """The whole batch on rank 0 (dumps); None elsewhere on the data plane."""
    if not isinstance(batch, ShardedBatch):
        return batch
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    everything, nothing = np.arange(len(batch)), np.arange(0)
    local = batch.gather([everything] + [nothing] * (world - 1), fields)
    return local if rank == 0 else None


# --------------------------------------------------------------------------- sums over the whole batch
def _all_reduce(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, group=object_group())
    return values


class _Whitening:
    """``verl_F.masked_whiten`` over the whole sharded batch: a first pass records each call's masked sums
    (count, sum, sum of squares; float64) on this rank's rows, a second whitens with the batch's statistics."""

    def __init__(self):
        self.local: list[torch.Tensor] = []
        self.total: list[torch.Tensor] | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        def record(values, mask, shift_mean=True):
            m = mask.to(torch.float64)
            v = values.to(torch.float64)
            self.local.append(torch.stack([m.sum(), (v * m).sum(), (v * v * m).sum()]))
            return values

        with _patched_whiten(record):
            yield

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        calls = iter(self.total or [])

        def whiten(values, mask, shift_mean=True):
            count, total, squares = next(calls).tolist()
            mean = total / (count + 1e-8)
            var = (squares - count * mean * mean) / (count + 1e-8) * count / (count - 1)
            whitened = (values - mean) * torch.rsqrt(torch.tensor(var + 1e-8, dtype=values.dtype))
            return whitened if shift_mean else whitened + mean

        with _patched_whiten(whiten):
            yield


@contextlib.contextmanager
def _patched_whiten(fn) -> Iterator[None]:
    original = verl_F.masked_whiten
    verl_F.masked_whiten = fn
    try:
        yield
    finally:
        verl_F.masked_whiten = original


ADVANTAGE_INPUTS = ("token_level_rewards", "response_mask", "responses", "attention_mask", "values",
                    "reward_baselines")


def compute_advantages(batch: Batch, estimator: str, **kwargs: Any) -> Batch:
    """``advantages`` and ``returns`` by the named estimator (see :func:`compute_advantage`)."""
    if not isinstance(batch, ShardedBatch):
        return compute_advantage(batch, estimator, **kwargs)
    inputs = [k for k in ADVANTAGE_INPUTS if k in batch.fields]
    _check_groups_whole(batch)

    def estimate(rows: DataProto) -> dict[str, torch.Tensor]:
        out = compute_advantage(rows, estimator, **kwargs)
        return {"advantages": out.batch["advantages"], "returns": out.batch["returns"]}

    # Pass 1 on each holder's rows: the estimator's batch-wide whitenings and their local sums. Pass 2 (only
    # when it whitens) with the batch's statistics, added up over the ranks.
    world = dist.get_world_size() if dist.is_initialized() else 1
    holder = batch.holder(ANCHOR).owner
    rows = batch.gather([np.flatnonzero(holder == r) for r in range(world)], inputs)
    whitening = _Whitening()
    result: dict[str, torch.Tensor] = {}
    if len(rows):
        with whitening.recording():
            result = estimate(rows)
    calls = max(all_gather_small(len(whitening.local)))
    if calls:  # every rank adds its sums, zeros where it holds no rows
        local = torch.stack(whitening.local) if whitening.local else torch.zeros(calls, 3, dtype=torch.float64)
        whitening.total = list(_all_reduce(local))
        if len(rows):
            with whitening.applying():
                result = estimate(rows)
    return batch.union(batch.from_local_results(holder, result))


def _check_groups_whole(batch: ShardedBatch) -> None:
    """Group estimators read a whole uid group: it must have one holder (it does after a rollout, which
    samples a prompt's n responses on one replica; a reorder moves no row)."""
    uid = batch.non_tensor_batch.get("uid")
    if uid is None:
        return
    owner = batch.holder(ANCHOR).owner
    holders: dict[Any, int] = {}
    for u, o in zip(uid.tolist(), owner.tolist(), strict=True):
        if holders.setdefault(u, o) != o:
            raise RuntimeError(f"data plane: the responses of group uid={u!r} are held by ranks {holders[u]} and "
                               f"{o}; group advantages need each group on one rank")


# --------------------------------------------------------------------------- metrics from per-row summaries
SUMMARY = ("score", "reward", "response_length", "prompt_length", "prompt_max", "response_max", "tokens",
           "adv_n", "adv_sum", "adv_max", "adv_min", "ret_sum", "ret_max", "ret_min",
           "val_sum", "val_max", "val_min", "ret_sq", "diff_sum", "diff_sq", "diff_max",
           "vminusr_sum", "vminusr_sq", "diff_n")


def _row_summary(rows: DataProto) -> torch.Tensor:
    """[rows, len(SUMMARY)] float64: what verl's data metrics read of each row."""
    b = rows.batch
    response_length = b["responses"].shape[-1]
    mask = b["response_mask"].bool() if "response_mask" in b.keys() else compute_response_mask(rows).bool()
    prompt_mask = b["attention_mask"][:, :-response_length].bool()
    m = mask.to(torch.float64)
    inf = torch.tensor(float("inf"), dtype=torch.float64)

    def masked(name):
        if name not in b.keys():
            zeros = torch.zeros(len(rows), dtype=torch.float64)
            return zeros, zeros, zeros, zeros
        x = b[name].to(torch.float32).to(torch.float64)
        return ((x * m).sum(-1), torch.where(mask, x, -inf).amax(-1), torch.where(mask, x, inf).amin(-1),
                (x * x * m).sum(-1))

    adv_sum, adv_max, adv_min, _ = masked("advantages")
    ret_sum, ret_max, ret_min, ret_sq = masked("returns")
    val_sum, val_max, val_min, _ = masked("values")
    if "values" in b.keys():
        d = (b["returns"].float() - b["values"].float()).to(torch.float64)
        vr_sum, vr_sq = (d * m).sum(-1), (d * d * m).sum(-1)
    else:
        vr_sum = vr_sq = torch.zeros(len(rows), dtype=torch.float64)
    if "rollout_log_probs" in b.keys() and "old_log_probs" in b.keys():
        diff = (b["rollout_log_probs"].exp() - b["old_log_probs"].exp()).abs().float().to(torch.float64)
        diff_sum, diff_sq = (diff * m).sum(-1), (diff * diff * m).sum(-1)
        diff_max = torch.where(mask, diff, -inf).amax(-1)
        diff_n = m.sum(-1)
    else:
        diff_sum = diff_sq = diff_n = torch.zeros(len(rows), dtype=torch.float64)
        diff_max = torch.full((len(rows),), -inf)
    columns = {
        "score": b["token_level_scores"].sum(-1).float().to(torch.float64),
        "reward": b["token_level_rewards"].sum(-1).float().to(torch.float64),
        "response_length": m.sum(-1), "prompt_length": prompt_mask.sum(-1).to(torch.float64),
        "prompt_max": torch.full((len(rows),), float(prompt_mask.shape[-1]), dtype=torch.float64),
        "response_max": torch.full((len(rows),), float(response_length), dtype=torch.float64),
        "tokens": b["attention_mask"].sum(-1).to(torch.float64),
        "adv_n": m.sum(-1), "adv_sum": adv_sum, "adv_max": adv_max, "adv_min": adv_min,
        "ret_sum": ret_sum, "ret_max": ret_max, "ret_min": ret_min,
        "val_sum": val_sum, "val_max": val_max, "val_min": val_min, "ret_sq": ret_sq,
        "diff_sum": diff_sum, "diff_sq": diff_sq, "diff_max": diff_max,
        "vminusr_sum": vr_sum, "vminusr_sq": vr_sq, "diff_n": diff_n,
    }
    return torch.stack([columns[name] for name in SUMMARY], dim=-1)


SUMMARY_INPUTS = ("responses", "response_mask", "attention_mask", "token_level_scores", "token_level_rewards",
                  "advantages", "returns", "values", "rollout_log_probs", "old_log_probs")


def row_summaries(batch: ShardedBatch) -> dict[str, torch.Tensor]:
    table = batch.row_values(_row_summary, [k for k in SUMMARY_INPUTS if k in batch.fields], ANCHOR)
    return {name: table[:, i] for i, name in enumerate(SUMMARY)}


def _stats(prefix: str, n: torch.Tensor, total: torch.Tensor, high: torch.Tensor, low: torch.Tensor):
    count = float(n.sum())
    if count == 0:
        return {}
    return {f"{prefix}/mean": float(total.sum()) / count, f"{prefix}/max": float(high.max()),
            f"{prefix}/min": float(low.min())}


def _var(n: float, total: float, squares: float) -> float:
    return (squares - total * total / n) / (n - 1)


def step_metrics(batch: Batch, use_critic: bool, timing: dict[str, float], world_size: int,
                 mfu: Callable[[list[int]], dict[str, float]], bypass_old_log_prob: bool) -> dict[str, float]:
    """verl's data, rollout-diff, timing and throughput metrics of the step (and MFU through ``mfu(seqlens)``)."""
    if not isinstance(batch, ShardedBatch):
        metrics = metric_utils.compute_data_metrics(batch, use_critic)
        if not bypass_old_log_prob:
            metrics.update(metric_utils.compute_rollout_probs_diff_metrics(batch))
        metrics.update(metric_utils.compute_timing_metrics(batch, timing))
        metrics.update(metric_utils.compute_throughput_metrics(batch, timing["step"], world_size))
        metrics.update(mfu(batch.batch["attention_mask"].sum(-1).tolist()))
        return metrics
    s = row_summaries(batch)
    metrics: dict[str, float] = {}
    for prefix, key in (("critic/score", "score"), ("critic/rewards", "reward")):
        metrics.update({f"{prefix}/mean": float(s[key].mean()), f"{prefix}/max": float(s[key].max()),
                        f"{prefix}/min": float(s[key].min())})
    metrics.update(_stats("critic/advantages", s["adv_n"], s["adv_sum"], s["adv_max"], s["adv_min"]))
    metrics.update(_stats("critic/returns", s["adv_n"], s["ret_sum"], s["ret_max"], s["ret_min"]))
    n = float(s["adv_n"].sum())
    if use_critic:
        metrics.update(_stats("critic/values", s["adv_n"], s["val_sum"], s["val_max"], s["val_min"]))
        residual = _var(n, float(s["vminusr_sum"].sum()), float(s["vminusr_sq"].sum()))
        metrics["critic/vf_explained_var"] = 1.0 - residual / (_var(n, float(s["ret_sum"].sum()),
                                                                     float(s["ret_sq"].sum())) + 1e-5)
    for name, top in (("response_length", "response_max"), ("prompt_length", "prompt_max")):
        values = s[name]
        metrics.update({f"{name}/mean": float(values.mean()), f"{name}/max": float(values.max()),
                        f"{name}/min": float(values.min()),
                        f"{name}/clip_ratio": float((values == s[top]).to(torch.float64).mean())})
    diff_n = float(s["diff_n"].sum())
    if not bypass_old_log_prob and diff_n:
        mean = float(s["diff_sum"].sum()) / diff_n
        metrics.update({"training/rollout_probs_diff_max": float(s["diff_max"].max()),
                        "training/rollout_probs_diff_mean": mean,
                        "training/rollout_probs_diff_std": max(0.0, float(s["diff_sq"].sum()) / diff_n - mean * mean)
                        ** 0.5})
    response_tokens, all_tokens = int(s["response_length"].sum()), int(s["tokens"].sum())
    metrics.update({f"timing_s/{name}": seconds for name, seconds in timing.items()})
    per_phase = {"gen": response_tokens, **{k: all_tokens for k in ("ref", "values", "adv", "update_critic",
                                                                    "update_actor", "old_log_prob")}}
    for name, tokens in per_phase.items():
        if name in timing and tokens:
            metrics[f"timing_per_token_ms/{name}"] = timing[name] * 1000.0 / tokens
    metrics.update({"perf/total_num_tokens": float(all_tokens), "perf/time_per_step": timing["step"],
                    "perf/throughput": all_tokens / max(timing["step"], 1e-9) / world_size})
    metrics.update(mfu([int(t) for t in s["tokens"].tolist()]))
    return metrics


def aggregate_rows(batch: Batch, field: str, loss_agg_mode: str) -> float:
    """verl's ``agg_loss(field, response_mask, loss_agg_mode)`` over the whole batch (``actor/entropy``)."""
    from verl.algorithms import core_algos

    if not isinstance(batch, ShardedBatch):
        return core_algos.agg_loss(batch.batch[field], batch.batch["response_mask"], loss_agg_mode).item()

    def sums(rows: DataProto) -> torch.Tensor:
        mask = rows.batch["response_mask"].to(torch.float64)
        x = rows.batch[field].to(torch.float64)
        return torch.stack([(x * mask).sum(-1), mask.sum(-1)], dim=-1)

    table = batch.row_values(sums, [field, "response_mask"], field)
    return _aggregate(table[:, 0], table[:, 1], loss_agg_mode, batch.fields[field].shape[-1])


def _aggregate(totals: torch.Tensor, counts: torch.Tensor, mode: str, width: int) -> float:
    has = counts > 0
    if mode == "token-mean":
        return float(totals.sum() / counts.sum())
    if mode == "token-sum":
        return float(totals.sum())
    per_seq = totals / (counts + 1e-8) if mode == "seq-mean-token-mean" else totals
    value = float(per_seq[has].sum() / has.sum())
    return value / width if mode == "seq-mean-token-sum-norm" else value
