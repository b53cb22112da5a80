"""``RLHFDataset(data_files=, tokenizer=, config={...})``: :class:`verl.utils.dataset.rl_dataset.RLHFDataset`
(``config``: verl's ``data.*`` keys as a dict or a config section)."""

from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn, create_rl_sampler

__all__ = ["RLHFDataset", "collate_fn", "create_rl_sampler"]
