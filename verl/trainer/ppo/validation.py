"""Validation: greedy decoding (``rollout.val_kwargs``) on ``data.val_files``, scored by the reward function
(``val/accuracy``, verl's ``val-core/<source>/reward/mean@1``), dumped to ``trainer.validation_data_dir``.

Rows marked ``extra_info.out_of_form`` (a held-out set in a form training never shows: ``verl data arithmetic`` /
``word-problems`` write them to ``test_ood.parquet``) are reported apart, as ``val/accuracy_out_of_form`` and
``val/num_samples_out_of_form``; ``val/accuracy`` and the ``val-core`` means cover the other rows (all rows when
every row is out of form)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl.trainer.metrics import reduce_metrics
from verl.trainer.ppo import batch_ops
from verl.trainer.ppo.context import Roles
from verl.trainer.ppo.generations import generation_records, write_generations
from verl.trainer.ppo.step import PPOStep


class Validation:
    """Validation of a PPO run on ``dataloader`` (the validation set), through the step's prompt batches, the
    actor's rollout and the reward function (``roles``)."""

    def __init__(self, sections: Any, roles: Roles, step: PPOStep, dataloader: Any, tokenizer: Any, *, rank: int):
        self.sections, self.roles, self.step, self.dataloader = sections, roles, step, dataloader
        self.tokenizer, self.rank = tokenizer, rank

    def __call__(self, global_step: int) -> dict[str, float]:
        """Greedy decoding (rollout.val_kwargs) on the validation set after step ``global_step``: val/accuracy and
        val-core names; the generations dumped as ``<validation_data_dir>/<global_step>.jsonl``."""
        scores, sources, generations, turn_stats, out_of_form = [], [], [], [], []
        dump_dir = self.sections.trainer.validation_data_dir
        for batch_dict in self.dataloader:
            gen = self.step.prompt_batch(batch_dict, step=0, validate=True)
            out = self.roles.actor_rollout_wg.generate_sequences(self.step.on_data_plane(gen))
            turn_stats.append((len(out), out.meta_info.pop("metrics", None) or {}))
            scores.append(self.step.sequence_rewards(out))
            sources.extend(batch_ops.column(out, self.sections.data.reward_fn_key).tolist())
            out_of_form.extend(is_out_of_form(out))
            rows = batch_ops.gather_to_rank0(out) if dump_dir else None
            if rows is not None and self.rank == 0:
                reward = self.roles.reward_fn(rows, return_dict=True)
                generations.extend(generation_records(rows, reward["reward_tensor"], reward["reward_extra_info"],
                                                      self.tokenizer, global_step))
        if dump_dir and self.rank == 0:
            write_generations(dump_dir, global_step, generations)
        return val_score_metrics(torch.cat(scores), sources, out_of_form) | agent_val_metrics(turn_stats)


def is_out_of_form(batch) -> list[bool]:
    """Per row: whether its ``extra_info`` marks it out of form (rows without ``extra_info`` are not)."""
    try:
        infos = batch_ops.column(batch, "extra_info")
    except KeyError:
        return [False] * len(batch)
    return [bool(isinstance(info, dict) and info.get("out_of_form")) for info in infos]


def val_score_metrics(score: torch.Tensor, sources: list, out_of_form: list[bool]) -> dict[str, float]:
    """``val/accuracy`` (and the per-source ``val-core`` means) over the in-form rows, or every row when none is;
    ``val/accuracy_out_of_form`` over the out-of-form rows, when there are any."""
    apart = torch.as_tensor(out_of_form, dtype=torch.bool)
    in_form = ~apart if bool((~apart).any()) else torch.ones_like(apart)
    metrics = {"val/accuracy": score[in_form].mean().item(), "val/num_samples": float(int(in_form.sum()))}
    if bool(apart.any()):
        metrics["val/accuracy_out_of_form"] = score[apart].mean().item()
        metrics["val/num_samples_out_of_form"] = float(int(apart.sum()))
    sources_arr = np.array(sources, dtype=object)
    for source in sorted({s for s, keep in zip(sources, in_form.tolist(), strict=True) if keep}):
        mask = torch.as_tensor(sources_arr == source) & in_form
        metrics[f"val-core/{source}/reward/mean@1"] = score[mask].mean().item()
    return metrics


AGENT_VAL_KEYS = ("num_turns", "tool_call_counts", "tool_call_errors")


def agent_val_metrics(batches: list[tuple[int, dict[str, Any]]]) -> dict[str, float]:
    """verl's ``val-aux/num_turns/{min,max,mean}`` (and the same for the tool-call counts) over the validation
    batches' multi-turn rollout metrics (each batch's ``meta_info["metrics"]``, one value per DP replica, reduced
    as the training step reduces them; batch means weighted by rows); empty for single-turn rollouts."""
    metrics: dict[str, float] = {}
    batches = [(n, reduce_metrics({k: v for k, v in m.items() if k.split("/")[0] in AGENT_VAL_KEYS}))
               for n, m in batches]
    for key in AGENT_VAL_KEYS:
        seen = [(n, m) for n, m in batches if f"{key}/mean" in m]
        if seen:
            metrics[f"val-aux/{key}/mean"] = sum(n * m[f"{key}/mean"] for n, m in seen) / sum(n for n, _ in seen)
            metrics[f"val-aux/{key}/min"] = min(m[f"{key}/min"] for _, m in seen)
            metrics[f"val-aux/{key}/max"] = max(m[f"{key}/max"] for _, m in seen)
    return metrics
