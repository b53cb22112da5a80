"""Where a PPO step's generated batches come from: the loop asks its trainer's batch source for what each step
starts from and for the step's generated batch(es), tells it what was trained and when the step ends (the
source syncs the rollout's weights where its mode does), and checkpoints what the source keeps.

- :class:`SyncBatchSource` (``trainer.v1.trainer_mode=sync``, verl's legacy trainer): one dataloader batch of
  prompts a step, generated now on the current weights;
- ``colocate_async`` / ``separate_async``: the replay-buffer and rollout-pool sources of :mod:`verl.trainer.v1`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from verl.errors import InputError
from verl.trainer.ppo.context import PhaseTimer, Roles, TrainData


@dataclasses.dataclass
class SourceContext:
    """What a batch source works with, handed to it by the trainer: the sections, the tokenizer, this rank's place,
    the roles (the rollout's worker group), the training prompts, the trainer's step (``prompt_batch``, ``generate``,
    ``on_data_plane``: :class:`~verl.trainer.ppo.step.PPOStep`), its timer, and its closing metrics (whose
    ``check_rollout_probs_once`` a source calls on the first batch the live weights generated when the step's own
    check cannot see it)."""

    sections: Any
    tokenizer: Any
    rank: int
    world_size: int
    roles: Roles
    data: TrainData
    step: Any
    timer: PhaseTimer
    end_metrics: Any


@dataclasses.dataclass
class Generated:
    """A generated batch to learn from: ``metrics`` is the dict its training writes into (the step's, or a
    mini-batch's that the source merges at the step's end); ``on_policy``: the live weights generated it."""

    batch: Any
    metrics: dict[str, float]
    on_policy: bool = True
    info: Any = None  # the source's own record of the batch (the prompt groups it holds)


class BatchSource:
    """The interface the loop drives (every method runs on every rank), over ``ctx`` (:class:`SourceContext`)."""

    # Trains on older weights' rollouts: the step logs the off-policy diagnostics (rollout_corr/*).
    off_policy = False

    def __init__(self, ctx: SourceContext):
        self.ctx = ctx

    def start(self, global_step: int) -> None:
        """Before this process's first step, ``global_step + 1`` (after a resume, the checkpoint's step)."""

    def step_inputs(self) -> Iterator[tuple[Any, dict[str, float]]]:
        """What each step starts from, and metrics the loop adds to that step's; asked once per step, only
        while steps remain."""
        while True:
            yield None, {}

    def generate(self, step_input: Any, step: int, metrics: dict[str, float]) -> Iterator[Generated]:
        """Step ``step``'s generated batches, in training order (``metrics``: the step's)."""
        raise NotImplementedError

    def trained(self, generated: Generated, batch: Any) -> None:
        """``generated`` was learnt from (``batch``: it after the updates)."""

    def end_step(self, step: int, metrics: dict[str, float],
                 trained: list[tuple[Generated, Any]]) -> tuple[Any, bool]:
        """After the step's updates, inside its timing: (the batch the step's metrics read, whether the
        weight-sync check may read it)."""
        generated, batch = trained[-1]
        return batch, generated.on_policy

    def state_dict(self) -> dict[str, Any]:
        """Checkpointed beside the trainer state: ``sampler`` (the prompts consumed) and what else it keeps."""
        raise NotImplementedError

    def save_files(self, staging: str) -> None:
        """Collective, inside the checkpoint's save: what the source keeps in files of its own under ``staging``
        (too large for the trainer state's JSON)."""

    def load_files(self, path: str) -> None:
        """Before :meth:`load_state_dict`: read what :meth:`save_files` wrote into checkpoint ``path``."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From a checkpoint's trainer state (``state["step"]``: the step it was saved after)."""
        raise NotImplementedError


class SyncBatchSource(BatchSource):
    """verl's sync mode: a step is one train batch of the dataloader, generated with the current weights."""

    def __init__(self, ctx: SourceContext):
        super().__init__(ctx)
        self.sampler = ctx.data.sampler
        # What the loop has consumed (the sampler's own position runs ahead when workers prefetch).
        self.data_epoch, self.data_position = self.sampler.epoch, self.sampler.position

    def step_inputs(self) -> Iterator[tuple[Any, dict[str, float]]]:
        while True:
            epoch_before = self.sampler.epoch
            self.data_epoch, self.data_position = self.sampler.epoch, self.sampler.position
            for batch_dict in self.ctx.data.dataloader:
                self.data_position += len(batch_dict["input_ids"])  # consumed by the step it is handed to
                yield batch_dict, {"training/epoch": epoch_before}
            # Only asked again when steps remain: the pass must have started a new epoch.
            if self.sampler.epoch == epoch_before:
                raise RuntimeError("train dataloader: expected a new epoch after a full pass, found none")

    def generate(self, step_input: Any, step: int, metrics: dict[str, float]) -> Iterator[Generated]:
        gen = self.ctx.step.prompt_batch(step_input, step, validate=False)
        yield Generated(self.ctx.step.generate(gen, step, metrics), metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_at(self.data_epoch, self.data_position)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "replay_buffer" in state:
            raise InputError("checkpoint: expected a sync run's checkpoint, found an asynchronous run's (with a "
                             "replay buffer): resume it with the trainer.v1.trainer_mode it was written with")
        self.sampler.load_state_dict(state["sampler"])
        self.data_epoch, self.data_position = self.sampler.epoch, self.sampler.position
