"""What the PPO trainer's parts share. The trainer builds each once and hands it to every part that needs it, as a
constructor argument: no part reads another's members or the trainer's.

- :class:`Roles`: the worker groups and the reward function a step calls. The Python API replaces the actor's
  group (a user's rollout function) and the reward function after the trainer is built, so the parts read them
  here at each call, never a copy.
- :class:`PhaseTimer`: a step's phase timings (``timing_s/<phase>``), rank 0's run timeline, the console lines.
- :class:`TrainData`: the training prompts: the dataset, its seeded sampler and the dataloader over both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from verl.utils.timeline import TRAINER_LANE, Timeline


@dataclasses.dataclass
class Roles:
    """The worker groups of a PPO job (``critic_wg`` / ``rm_wg`` None where the job runs no critic / reward model)
    and the reward function that scores generated rows."""

    actor_rollout_wg: Any
    critic_wg: Any = None
    rm_wg: Any = None
    reward_fn: Any = None


class PhaseTimer:
    """Times a step's phases into ``timing`` (a phase run twice in a step adds up), onto ``timeline`` (rank 0's,
    from the run's start; None elsewhere), with one console line a phase through ``say``."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.timing: dict[str, float] = {}
        self.timeline: Timeline | None = None

    def reset(self) -> None:
        """A new step's timings."""
        self.timing = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start, wall = time.perf_counter(), time.time()
        yield
        seconds = time.perf_counter() - start
        self.timing[name] = self.timing.get(name, 0.0) + seconds
        if self.timeline is not None:
            self.timeline.add(TRAINER_LANE, name, wall, wall + seconds)
        if name != "step":
            self.say(f"[{name}] {seconds:.2f}s")


@dataclasses.dataclass
class TrainData:
    """The training prompts: ``dataset`` (an RLHFDataset), its seeded ``sampler`` (whose position checkpoints
    record) and the ``dataloader`` that draws train batches with it."""

    dataset: Any
    sampler: Any
    dataloader: Any
