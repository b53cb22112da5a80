"""Validation: greedy decoding (``rollout.val_kwargs``) on ``data.val_files``, scored by the reward function
(``val/accuracy``, verl's ``val-core/<source>/reward/mean@1``), dumped to ``trainer.validation_data_dir``."""

from __future__ import annotations

import numpy as np
import torch

from verl.trainer.ppo import batch_ops
from verl.trainer.ppo.generations import generation_records, write_generations


class Validation:
    """The trainer's ``validate`` (reads ``val_dataloader``, the actor group and ``reward_fn``)."""

    def validate(self) -> dict[str, float]:
        """Greedy decoding (rollout.val_kwargs) on the validation set: val/accuracy and val-core names."""
        scores, sources, generations = [], [], []
        dump_dir = self.sections.trainer.validation_data_dir
        for batch_dict in self.val_dataloader:
            gen = self._prompt_batch(batch_dict, step=0, validate=True)
            out = self.actor_rollout_wg.generate_sequences(self._on_data_plane(gen))
            out.meta_info.pop("metrics", None)
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
        return metrics
