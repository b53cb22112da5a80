"""The PPO loop's dataloaders (verl's ``data.dataloader_num_workers``) and the batch layout ``trainer.balance_batch``
keeps (which rows may move between actor DP ranks)."""

from __future__ import annotations

import math
import os
from typing import Any

from verl.trainer.config import actor_dp_size, use_critic

# The prompt fields generation reads from a train batch.
PROMPT_FIELDS = ("input_ids", "attention_mask", "position_ids")
# Per DataLoader worker, batches loaded ahead (torch's default is 2): workers are forks of a rank.
PREFETCH_BATCHES = 1


def _worker_dies_with_rank(rank_pid: int, worker_id: int) -> None:
    from verl.launcher.spawn import die_with_parent

    die_with_parent(rank_pid)


def rl_dataloader(dataset: Any, batch_size: int, num_workers: int, sampler: Any = None, drop_last: bool = False):
    """verl's dataloader for ``dataset`` with ``data.dataloader_num_workers`` workers, capped at the batches
    of one pass (a worker loads whole batches). Workers are forks of this rank that die with it, started per
    pass (not persistent) and loading one batch ahead each, so they hold little memory. The sampler's own
    position then runs ahead of what the loop consumed: the trainer checkpoints its consumed count instead."""
    from torch.utils.data import DataLoader

    from verl.utils.dataset.rl_dataset import collate_fn

    batches = len(dataset) // batch_size if drop_last else -(-len(dataset) // batch_size)
    workers = min(int(num_workers), max(batches, 1))
    options: dict[str, Any] = {}
    if workers > 0:
        import functools
        import multiprocessing

        options = dict(prefetch_factor=PREFETCH_BATCHES, persistent_workers=False,
                       worker_init_fn=functools.partial(_worker_dies_with_rank, os.getpid()))
        if "fork" in multiprocessing.get_all_start_methods():
            options["multiprocessing_context"] = "fork"
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False, collate_fn=collate_fn,
                      drop_last=drop_last, num_workers=workers, **options)


def balance_layout(config: Any, world_size: int) -> tuple[int, int]:
    """(actor DP size, rows per rank whose set ``balance_batch`` keeps). Each DP rank cuts its share into
    mini-batches of ppo_mini_batch_size * n / dp rows (actor, and critic when there is one); a block that
    divides both keeps every mini-batch's set of sequences, so the balanced step optimises the same thing.
    A role that shuffles its mini-batches (``shuffle``) draws them at random from the rank's share anyway."""
    arr = config.actor_rollout_ref
    dp = actor_dp_size(config, world_size)
    n = arr.rollout.n
    roles = [arr.actor] + ([config.critic] if use_critic(config) else [])
    sizes = [role.ppo_mini_batch_size * n // dp for role in roles if not role.shuffle]
    return dp, math.gcd(*sizes) if sizes else config.data.train_batch_size * n // dp
