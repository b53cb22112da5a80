"""Validation: greedy decoding (``rollout.val_kwargs``) on ``data.val_files``, scored by the reward function
(``val/accuracy``, verl's ``val-core/<source>/reward/mean@1``), dumped to ``trainer.validation_data_dir``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl.trainer.metrics import reduce_metrics
from verl.trainer.ppo import batch_ops
from verl.trainer.ppo.generations import generation_records, write_generations


class Validation:
    """The trainer's ``validate`` (reads ``val_dataloader``, the actor group and ``reward_fn``)."""

    def validate(self) -> dict[str, float]:
        """Greedy decoding (rollout.val_kwargs) on the validation set: val/accuracy and val-core names."""
        scores, sources, generations, turn_stats = [], [], [], []
        dump_dir = self.sections.trainer.validation_data_dir
        for batch_dict in self.val_dataloader:
            gen = self._prompt_batch(batch_dict, step=0, validate=True)
            out = self.actor_rollout_wg.generate_sequences(self._on_data_plane(gen))
            turn_stats.append((len(out), out.meta_info.pop("metrics", None) or {}))
            scores.append(self._sequence_rewards(out))
            sources.extend(batch_ops.column(out, self.sections.data.reward_fn_key).tolist())
            rows = batch_ops.gather_to_rank0(out) if dump_dir else None
            if rows is not None and self.rank == 0:
                reward = self.reward_fn(rows, return_dict=True)
                generations.extend(generation_records(rows, reward["reward_tensor"], reward["reward_extra_info"],
                                                      self.tokenizer, self.global_step))
        if dump_dir and self.rank == 0:
            write_generations(dump_dir, self.global_step, generations)
        score = torch.cat(scores)
        metrics = {"val/accuracy": score.mean().item(), "val/num_samples": float(score.numel())}
        sources_arr = np.array(sources, dtype=object)
        for source in sorted(set(sources)):
            mask = torch.as_tensor(sources_arr == source)
            metrics[f"val-core/{source}/reward/mean@1"] = score[mask].mean().item()
        return metrics | agent_val_metrics(turn_stats)


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
