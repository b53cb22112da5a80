"""The PPO trainer in this process, without `verl train`'s launcher: :class:`LocalPPOTrainer` runs every role in
this one process (``trainer.nnodes=1``, ``n_gpus_per_node=1``), its config and torch.distributed prepared as
``main_ppo`` prepares them (:mod:`verl.trainer.prepare`), ``fit`` printing each phase's time (``[gen] 0.12s``,
``[ref]``, ``[values]``, ``[adv]``, ``[update_actor]``): the trainer `verl train` runs, so a 1-rank `verl train` of the
same config logs the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl.errors import InputError
from verl.trainer.prepare import prepare

ONE_PROCESS = ("trainer.nnodes=1", "trainer.n_gpus_per_node=1")


class LocalPPOTrainer:
    """Every role of a PPO run in this process, no launcher. ``config_path`` (or ``config``: a dict / OmegaConf
    config) with verl's keys; ``train_dataset``: an :class:`~verl.utils.dataset.rl_dataset.RLHFDataset` in place of
    ``data.train_files``; ``overrides``: ``key=value`` strings. The trainer is `verl train`'s
    (:func:`verl.trainer.v1.trainer_class`), built on first use (``.trainer``)."""

    def __init__(self, config_path: str | None = None, train_dataset: Any = None, *, config: Any = None,
                 overrides: Sequence[str] = ()):
        if (config_path is None) == (config is None):
            raise InputError("LocalPPOTrainer: expected one of config_path= or config=, found "
                             + ("both" if config_path is not None else "neither"))
        self.config, self.tokenizer, self._owns_distributed = prepare(
            config_path if config_path is not None else config, [*ONE_PROCESS, *overrides])
        from verl.trainer.v1 import trainer_class

        self.trainer = trainer_class(self.config)(self.config, self.tokenizer, train_dataset=train_dataset)

    def fit(self) -> int:
        """Train to ``trainer.total_training_steps`` (or the epochs' steps); returns the exit code `verl train`
        would. The workers are closed afterwards; the trainer's metrics stay readable (``metrics.jsonl``)."""
        try:
            return self.trainer.fit()
        finally:
            self.close()

    def close(self) -> None:
        self.trainer.close()
