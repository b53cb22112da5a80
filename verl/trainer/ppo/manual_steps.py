"""Stepping the PPO trainer by hand (the Python API: a script or a notebook drives the steps, not ``fit``):

    data = trainer.rollout(batch)      # generate + rewards + old/ref log-probs + values + advantages
    metrics = trainer.update(data)     # critic and actor updates; metrics["loss"], trainer.global_step += 1

Both run the step's own phases (:class:`~verl.trainer.ppo.step.PPOStep`: ``generate``, ``experience``,
``update_models``) on the trainer's worker groups, so one rollout + update is one ``train_step`` of the sync trainer.
``reward_worker`` is the reward-model worker under the documents' name (``load_model(path)``: the hot swap of
``reward_model.hot_swap``).
"""

from __future__ import annotations

from typing import Any

from verl.errors import InputError
from verl.protocol import DataProto
from verl.trainer.ppo.context import PhaseTimer, Roles
from verl.trainer.ppo.reward_swap import RewardModelSwap
from verl.trainer.ppo.step import PPOStep
from verl.trainer.ppo.step_metrics import StepEndMetrics


class RewardWorkerHandle:
    """The trainer's reward model: ``load_model(path)`` swaps it between steps on every rank (the checkpoints
    record it, as a configured hot swap's); ``path``: the model in use."""

    def __init__(self, swap: RewardModelSwap, roles: Roles):
        self._swap, self._roles = swap, roles

    @property
    def path(self) -> str:
        return self._swap.path

    def load_model(self, path: str) -> None:
        self._swap.swap(str(path))

    def compute_rm_score(self, batch: DataProto) -> DataProto:
        return self._roles.rm_wg.compute_rm_score(batch)


class ManualSteps:
    """``rollout`` / ``update`` over the trainer's step (``step``, its closing metrics ``end_metrics``) and train
    dataloader; the step number comes from the trainer, which advances it when :meth:`update` returns."""

    def __init__(self, step: PPOStep, end_metrics: StepEndMetrics, timer: PhaseTimer, dataloader: Any):
        self.step, self.end_metrics, self.timer, self.dataloader = step, end_metrics, timer, dataloader
        self._pending: tuple[Any, dict[str, float], int] | None = None
        self._batches: Any = None

    def _next_train_batch(self) -> dict[str, Any]:
        if self._batches is None:
            self._batches = iter(self.dataloader)
        try:
            return next(self._batches)
        except StopIteration:  # a new epoch of the seeded sampler
            self._batches = iter(self.dataloader)
            return next(self._batches)

    def rollout(self, batch: Any, step: int) -> DataProto:
        """Step ``step``'s experience from ``batch`` (a train-dataloader batch dict, or a DataProto of prompts with
        ``input_ids``/``attention_mask``/``position_ids`` and the reward's non-tensor fields; None: the next batch
        of the train dataloader): ``responses``, ``rollout_log_probs``, ``old_log_probs``, ``token_level_scores`` /
        ``token_level_rewards``, ``advantages`` (and ``ref_log_prob``, ``values``)."""
        if batch is None:
            batch = self._next_train_batch()
        if isinstance(batch, DataProto):
            missing = [k for k in ("input_ids", "attention_mask", "position_ids") if k not in batch.batch.keys()]
            if missing:
                raise InputError(f"rollout(batch): expected the prompt fields {missing}, found only "
                                 f"{sorted(batch.batch.keys())}")
            batch = {**{k: batch.batch[k] for k in batch.batch.keys()}, **batch.non_tensor_batch}
        elif not isinstance(batch, dict) or "input_ids" not in batch:
            raise InputError(f"rollout(batch): expected a DataProto or a dataloader batch dict with input_ids, found "
                             f"{type(batch).__name__}")
        self.timer.reset()
        metrics: dict[str, float] = {}
        with self.timer("step"):
            gen = self.step.prompt_batch(batch, step, validate=False)
            data = self.step.experience(self.step.generate(gen, step, metrics), metrics, step)
        self._pending = (data, metrics, step)
        return data

    def update(self, rollout_data: Any) -> dict[str, float]:
        """The critic and actor updates on ``rollout_data`` (what :meth:`rollout` returned); returns the step's
        metrics (verl's names, ``training/global_step``, and ``loss``: the actor's ``actor/pg_loss``)."""
        pending = self._pending
        if pending is None or pending[0] is not rollout_data:
            raise InputError("update(rollout_data): expected the batch the last trainer.rollout() returned, found "
                             + ("no rollout yet" if pending is None else "another batch"))
        data, metrics, step = pending
        self._pending = None
        with self.timer("step"):
            data = self.step.update_models(data, metrics, step)
        metrics = self.end_metrics(data, metrics, on_policy=True)
        metrics["training/global_step"] = step
        if "actor/pg_loss" in metrics:
            metrics["loss"] = metrics["actor/pg_loss"]
        return metrics
