"""``verl.data.DataLoader``: the PPO trainer's own batches of an RL dataset, for a script.

    from verl.data import DataLoader
    from verl.data.rlhf_dataset import RLHFDataset
    loader = DataLoader(RLHFDataset(data_files=..., tokenizer=tok, config={...}), batch_size=4, seed=1)
    for batch in loader:                  # verl's batch dicts: input_ids, attention_mask, position_ids, raw fields
        data = trainer.rollout(batch)     # verl.trainer.ppo.PPOTrainer stepped by hand
    RLTrainer(pipeline=DataPipeline(..., dataset=loader)).run()   # the trainer takes its size, shuffle and seed

It is ``torch.utils.data.DataLoader`` with verl's ``collate_fn`` and the trainer's seeded resumable sampler
(``data.shuffle`` / ``data.seed``), so a seed draws the batches `verl train` draws.
"""

from __future__ import annotations

from typing import Any

import torch.utils.data

from verl.errors import InputError
from verl.utils.dataset.rl_dataset import collate_fn, create_rl_sampler


class DataLoader(torch.utils.data.DataLoader):
    def __init__(self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 1, drop_last: bool = True,
                 num_workers: int = 0):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise InputError(f"DataLoader(batch_size): expected a positive int, found {batch_size!r}")
        if len(dataset) < batch_size and drop_last:
            raise InputError(f"DataLoader: expected at least batch_size={batch_size} rows, found {len(dataset)}")
        self.shuffle, self.seed = bool(shuffle), int(seed)
        sampler = create_rl_sampler({"shuffle": self.shuffle, "seed": self.seed}, dataset)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                         drop_last=drop_last, num_workers=num_workers)
