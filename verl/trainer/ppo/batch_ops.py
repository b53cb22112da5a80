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
from verl.single_controller.data_plane import ColumnGroup, ShardedBatch, max_over_ranks, object_group
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
        return batch.union(ShardedBatch(len(batch), [ColumnGroup.replicate(dict(fields), len(batch), rank)],
                                        row_ids=batch.row_ids))
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
    """The whole batch on rank 0 (dumps, debug lines); None elsewhere on the data plane."""
    if not isinstance(batch, ShardedBatch):
        return batch
    rank = dist.get_rank() if dist.is_initialized() else 0
    everything, nothing = np.arange(len(batch)), np.arange(0)
    local = batch.gather(lambda r: everything if r == 0 else nothing, fields)
    return local if rank == 0 else None


def column(batch: Batch, name: str) -> np.ndarray:
    """A per-row object column (``non_tensor_batch[name]``) on every rank (validation's data sources)."""
    if isinstance(batch, ShardedBatch):
        return batch.to_dataproto([name]).non_tensor_batch[name]
    return batch.non_tensor_batch[name]


def batch_sum(batch: Batch, fn: Callable[[DataProto], torch.Tensor], inputs: Iterable[str],
              anchor: str = ANCHOR) -> float:
    """The sum over every row of ``fn(rows) -> [rows]`` (one all-reduce on the data plane)."""
    if isinstance(batch, ShardedBatch):
        return batch.reduce_rows(lambda rows: {"sum": fn(rows).to(torch.float64).sum()}, list(inputs), anchor,
                                 {"sum": "sum"})["sum"]
    return float(fn(batch).to(torch.float64).sum())


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
            self.local.append(verl_F.whiten_statistics(values, mask))
            return values

        with _patched_whiten(record):
            yield

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        calls = iter(self.total or [])

        def whiten(values, mask, shift_mean=True):
            return verl_F.whiten_with(values, next(calls), shift_mean)

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
                    "reward_baselines", "uid")


def compute_advantages(batch: Batch, estimator: str, **kwargs: Any) -> Batch:
    """``advantages`` and ``returns`` by the named estimator (see :func:`compute_advantage`)."""
    if not isinstance(batch, ShardedBatch):
        return compute_advantage(batch, estimator, **kwargs)
    inputs = [k for k in ADVANTAGE_INPUTS if k in batch.fields]

    def estimate(rows: DataProto) -> dict[str, torch.Tensor]:
        out = compute_advantage(rows, estimator, **kwargs)
        return {"advantages": out.batch["advantages"], "returns": out.batch["returns"]}

    # Pass 1 on each holder's rows: the estimator's batch-wide whitenings and their local sums. Pass 2 (only
    # when it whitens) with the batch's statistics, added up over the ranks.
    positions, rows = batch.local_rows(ANCHOR, inputs)
    _check_groups_whole(rows, kwargs.get("num_repeat", 1))
    whitening = _Whitening()
    result: dict[str, torch.Tensor] = {}
    if len(positions):
        with whitening.recording():
            result = estimate(rows)
    calls = max_over_ranks(len(whitening.local))
    if calls:  # every rank adds its sums, zeros where it holds no rows
        local = torch.stack(whitening.local) if whitening.local else torch.zeros(calls, 3, dtype=torch.float64)
        whitening.total = list(_all_reduce(local))
        if len(positions):
            with whitening.applying():
                result = estimate(rows)
    return batch.union(batch.from_local_results(batch.holder(ANCHOR).owner, result))


def _check_groups_whole(rows: DataProto, group_size: int) -> None:
    """Group estimators read whole uid groups: each must be on one holder. A rollout samples a prompt's n
    responses on one replica and a reorder moves no row, so each holder sees whole groups of ``group_size``;
    a group split between holders shows up here as a smaller one."""
    uid = rows.non_tensor_batch.get("uid")
    if uid is None or not len(uid):
        return
    values, counts = np.unique(uid.astype(str), return_counts=True)
    short = values[counts != group_size]
    if short.size:
        raise RuntimeError(f"data plane: group uid={short[0]!r} has {counts[counts != group_size][0]} of its "
                           f"{group_size} responses on this rank; group advantages need each group on one rank")


# --------------------------------------------------------------------------- metrics from per-rank partials
SUMMARY_INPUTS = ("responses", "response_mask", "attention_mask", "token_level_scores", "token_level_rewards",
                  "advantages", "returns", "values", "rollout_log_probs", "old_log_probs")


def _partials(rows: DataProto) -> dict[str, torch.Tensor]:
    """This rank's share of verl's data metrics: sums, counts and extremes (float64) over its rows."""
    b = rows.batch
    keys = set(b.keys())
    response_length = b["responses"].shape[-1]
    mask = b["response_mask"].bool() if "response_mask" in keys else compute_response_mask(rows).bool()
    prompt_mask = b["attention_mask"][:, :-response_length].bool()
    m = mask.to(torch.float64)
    out: dict[str, torch.Tensor] = {"rows": torch.tensor(float(len(rows)), dtype=torch.float64),
                                    "tokens": m.sum()}

    def per_row(prefix: str, values: torch.Tensor) -> None:
        out.update({f"{prefix}/sum": values.sum(), f"{prefix}/max": values.max(), f"{prefix}/min": values.min()})

    def per_token(prefix: str, values: torch.Tensor) -> None:
        picked = values.float().to(torch.float64)[mask]
        out.update({f"{prefix}/sum": picked.sum(), f"{prefix}/sq": (picked * picked).sum(),
                    f"{prefix}/max": picked.max() if picked.numel() else torch.tensor(float("-inf")),
                    f"{prefix}/min": picked.min() if picked.numel() else torch.tensor(float("inf"))})

    per_row("critic/score", b["token_level_scores"].sum(-1).float().to(torch.float64))
    per_row("critic/rewards", b["token_level_rewards"].sum(-1).float().to(torch.float64))
    for prefix, name in (("critic/advantages", "advantages"), ("critic/returns", "returns"),
                         ("critic/values", "values")):
        if name in keys:
            per_token(prefix, b[name])
    if "values" in keys:
        per_token("residual", b["returns"].float() - b["values"].float())
    if "rollout_log_probs" in keys and "old_log_probs" in keys:
        per_token("training/rollout_probs_diff", (b["rollout_log_probs"].exp() - b["old_log_probs"].exp()).abs())
        per_token("training/rollout_log_probs_diff", (b["rollout_log_probs"] - b["old_log_probs"]).abs())
    lengths = {"response_length": m.sum(-1), "prompt_length": prompt_mask.sum(-1).to(torch.float64)}
    tops = {"response_length": response_length, "prompt_length": prompt_mask.shape[-1]}
    for name, values in lengths.items():
        per_row(name, values)
        out[f"{name}/clipped"] = (values == tops[name]).to(torch.float64).sum()
    out["seq_tokens"] = b["attention_mask"].sum().to(torch.float64)
    return out


def _op(name: str) -> str:
    return "max" if name.endswith("/max") else "min" if name.endswith("/min") else "sum"


def step_metrics(batch: Batch, use_critic: bool, timing: dict[str, float], world_size: int,
                 mfu: Callable[[Callable[[], list[int]]], dict[str, float]],
                 bypass_old_log_prob: bool) -> dict[str, float]:
    """verl's data, rollout-diff, timing and throughput metrics of the step; ``mfu(seqlens)`` the MFU metrics
    from a function giving every row's valid-token count."""
    if not isinstance(batch, ShardedBatch):
        metrics = metric_utils.compute_data_metrics(batch, use_critic)
        if not bypass_old_log_prob:
            metrics.update(metric_utils.compute_rollout_probs_diff_metrics(batch))
        metrics.update(metric_utils.compute_timing_metrics(batch, timing))
        metrics.update(metric_utils.compute_throughput_metrics(batch, timing["step"], world_size))
        metrics.update(mfu(lambda: batch.batch["attention_mask"].sum(-1).tolist()))
        return metrics
    inputs = [k for k in SUMMARY_INPUTS if k in batch.fields]
    # The partials' names: the same on every holder; a rank holding no rows contributes identities.
    names = _partial_names(batch, inputs)
    t = batch.reduce_rows(_partials, inputs, ANCHOR, {n: _op(n) for n in names})
    rows, tokens = t["rows"], t["tokens"]
    metrics: dict[str, float] = {}
    for prefix in ("critic/score", "critic/rewards", "response_length", "prompt_length"):
        metrics.update({f"{prefix}/mean": t[f"{prefix}/sum"] / rows, f"{prefix}/max": t[f"{prefix}/max"],
                        f"{prefix}/min": t[f"{prefix}/min"]})
    for prefix in ("response_length", "prompt_length"):
        metrics[f"{prefix}/clip_ratio"] = t[f"{prefix}/clipped"] / rows
    token_prefixes = ["critic/advantages", "critic/returns"] + (["critic/values"] if use_critic else [])
    for prefix in token_prefixes:
        if f"{prefix}/sum" in t and tokens:
            metrics.update({f"{prefix}/mean": t[f"{prefix}/sum"] / tokens, f"{prefix}/max": t[f"{prefix}/max"],
                            f"{prefix}/min": t[f"{prefix}/min"]})
    if use_critic and "residual/sum" in t:
        metrics["critic/vf_explained_var"] = 1.0 - _var(tokens, t["residual/sum"], t["residual/sq"]) / (
            _var(tokens, t["critic/returns/sum"], t["critic/returns/sq"]) + 1e-5)
    diff = "training/rollout_probs_diff"
    if not bypass_old_log_prob and f"{diff}/sum" in t and tokens:
        mean = t[f"{diff}/sum"] / tokens
        metrics.update({f"{diff}_max": t[f"{diff}/max"], f"{diff}_mean": mean,
                        f"{diff}_std": max(0.0, t[f"{diff}/sq"] / tokens - mean * mean) ** 0.5,
                        "training/rollout_log_probs_diff_max": t["training/rollout_log_probs_diff/max"]})
    response_tokens, all_tokens = int(tokens), int(t["seq_tokens"])
    metrics.update({f"timing_s/{name}": seconds for name, seconds in timing.items()})
    per_phase = {"gen": response_tokens, **{k: all_tokens for k in ("ref", "values", "adv", "update_critic",
                                                                    "update_actor", "old_log_prob")}}
    for name, count in per_phase.items():
        if name in timing and count:
            metrics[f"timing_per_token_ms/{name}"] = timing[name] * 1000.0 / count
    metrics.update({"perf/total_num_tokens": float(all_tokens), "perf/time_per_step": timing["step"],
                    "perf/throughput": all_tokens / max(timing["step"], 1e-9) / world_size})
    # MFU reads every row's length (a few bytes per row), asked for only on a device with a known peak.
    metrics.update(mfu(lambda: [int(v) for v in batch.row_values(lambda rows: rows.batch["attention_mask"].sum(-1),
                                                                 ["attention_mask"], ANCHOR).tolist()]))
    return metrics


def _partial_names(batch: ShardedBatch, inputs: list[str]) -> list[str]:
    """The partials :func:`_partials` computes for a batch with fields ``inputs`` (no rows needed)."""
    names = ["rows", "tokens", "seq_tokens"]
    for prefix in ("critic/score", "critic/rewards", "response_length", "prompt_length"):
        names += [f"{prefix}/sum", f"{prefix}/max", f"{prefix}/min"]
    names += ["response_length/clipped", "prompt_length/clipped"]
    token = [("critic/advantages", "advantages"), ("critic/returns", "returns"), ("critic/values", "values")]
    if "values" in inputs:
        token.append(("residual", "values"))
    if "rollout_log_probs" in inputs and "old_log_probs" in inputs:
        token += [("training/rollout_probs_diff", "old_log_probs"),
                  ("training/rollout_log_probs_diff", "old_log_probs")]
    for prefix, needed in token:
        if needed in inputs:
            names += [f"{prefix}/sum", f"{prefix}/sq", f"{prefix}/max", f"{prefix}/min"]
    return names


def _var(n: float, total: float, squares: float) -> float:
    """Unbiased variance from a count, a sum and a sum of squares (torch.var's, over the same elements)."""
    return (squares - total * total / n) / (n - 1)


def aggregate_rows(batch: Batch, field: str, loss_agg_mode: str) -> float:
    """verl's ``agg_loss(field, response_mask, loss_agg_mode)`` over the whole batch (``actor/entropy``)."""
    from verl.algorithms import core_algos

    if not isinstance(batch, ShardedBatch):
        return core_algos.agg_loss(batch.batch[field], batch.batch["response_mask"], loss_agg_mode).item()

    def partial(rows: DataProto) -> dict[str, torch.Tensor]:
        mask = rows.batch["response_mask"].to(torch.float64)
        totals, counts = (rows.batch[field].to(torch.float64) * mask).sum(-1), mask.sum(-1)
        has = counts > 0
        return {"tokens": counts.sum(), "total": totals.sum(), "sequences": has.sum(),
                "seq_means": (totals / (counts + 1e-8))[has].sum(), "seq_totals": totals[has].sum()}

    t = batch.reduce_rows(partial, [field, "response_mask"], field,
                          dict.fromkeys(("tokens", "total", "sequences", "seq_means", "seq_totals"), "sum"))
    if loss_agg_mode == "token-mean":
        return t["total"] / t["tokens"]
    if loss_agg_mode == "token-sum":
        return t["total"]
    value = (t["seq_means"] if loss_agg_mode == "seq-mean-token-mean" else t["seq_totals"]) / t["sequences"]
    return value / batch.fields[field].shape[-1] if loss_agg_mode == "seq-mean-token-sum-norm" else value
