"""The replay buffer of prompt groups between generation and training (verl's V1 ``ReplayBufferAsync``).

Prompts are drawn one at a time (:class:`PromptStream`, over the resumable sampler's epochs) and submitted to
generation tagged with the global step they were submitted at, ``P``. A group (a prompt's ``n`` trajectories)
moves *in flight* -> *finished* -> *sampled* (trained) or *evicted* (dropped). At global step ``G`` a group's
age is ``G - P + 1`` model versions (verl's count: a prompt submitted at step P is trainable through step
P + threshold - 1):

* ``drop``: a finished group older than ``trainer.v1.sampler.max_off_policy_threshold`` is evicted before
  sampling, and exactly one new prompt is drawn in its place;
* ``wait``: nothing is evicted; sampling waits while any in-flight group has age >= the threshold (the
  generation segment must let those finish: :meth:`required_uids`).

Sampling takes the oldest finished groups first (by ``P``, then by the order they finished). Every prompt drawn
is accounted for: trained once, or evicted and counted (:attr:`ledger`). The state (finished groups, the
prompts in flight, the stream's position, the counters) survives a checkpoint; prompts that were in flight
are reissued after a resume, tagged with the step they are reissued at (verl does the same).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from verl.engine.rollout.partial import PromptGroup, Trajectory

DROP, WAIT = "drop", "wait"
STRATEGIES = (DROP, WAIT)


class PromptStream:
    """Dataset indices, one at a time, epoch after epoch, from a :class:`ResumableSampler` (its ``epoch`` and
    ``position`` are the stream's: the count of prompts drawn, exactly)."""

    def __init__(self, sampler: Any):
        self.sampler = sampler
        self._order: list[int] | None = None

    def draw(self) -> tuple[int, int]:
        """(dataset index, epoch) of the next prompt."""
        s = self.sampler
        if s.position >= s.num_samples:
            s.epoch, s.position = s.epoch + 1, 0
            self._order = None
        if self._order is None:
            self._order = s._order(s.epoch)
        index = self._order[s.position]
        s.position += 1
        return index, s.epoch

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._order = None


@dataclasses.dataclass
class Ledger:
    """Prompt accounting: groups submitted (drawn or reissued), trained and evicted, and the staleness of the
    evicted ones (verl's ``training/off_policy/evicted_samples*``, reset each step)."""

    drawn: int = 0
    trained: int = 0
    evicted: int = 0
    reissued: int = 0
    step_evicted_ages: list[int] = dataclasses.field(default_factory=list)
    step_evicted_uids: list[str] = dataclasses.field(default_factory=list)


class ReplayBuffer:
    """Prompt groups in flight and finished, with verl's staleness policy. Every rank of a colocated trainer
    holds an identical copy (the same prompts, the same generations); a standalone pool's trainer keeps it on
    training rank 0."""

    def __init__(self, threshold: int, strategy: str, make_group: Callable[[int, int, int], PromptGroup],
                 stream: PromptStream):
        if strategy not in STRATEGIES:
            raise ValueError(f"max_off_policy_strategy: expected one of {STRATEGIES}, found {strategy!r}")
        self.threshold, self.strategy = int(threshold), strategy
        self.make_group, self.stream = make_group, stream
        self.in_flight: dict[str, PromptGroup] = {}
        self.finished: list[PromptGroup] = []
        self.ledger = Ledger()
        self._finish_order = 0

    # ------------------------------------------------------------------ submission
    def submit(self, count: int, step: int) -> list[PromptGroup]:
        """Draw ``count`` prompts and put them in flight, tagged with ``step``; returns the new groups."""
        groups = []
        for _ in range(count):
            index, epoch = self.stream.draw()
            group = self.make_group(index, epoch, step)
            if group.uid in self.in_flight:
                raise RuntimeError(f"replay buffer: prompt {group.uid} drawn twice in one epoch")
            self.in_flight[group.uid] = group
            groups.append(group)
        self.ledger.drawn += count
        return groups

    def age(self, group: PromptGroup, step: int) -> int:
        return step - group.submit_step + 1

    def collect_finished(self) -> int:
        """Move groups whose every trajectory finished from in flight to finished; returns how many moved."""
        done = [uid for uid, group in self.in_flight.items() if group.finished]
        for uid in done:
            group = self.in_flight.pop(uid)
            group.finish_order = self._finish_order
            self._finish_order += 1
            self.finished.append(group)
        return len(done)

    # ------------------------------------------------------------------ staleness
    def evict_stale(self, step: int) -> tuple[list[PromptGroup], list[PromptGroup]]:
        """``drop``: remove finished groups older than the threshold and draw one new prompt for each (tagged
        ``step``); returns (the evicted groups, their replacements). Nothing is evicted under ``wait``."""
        if self.strategy != DROP:
            return [], []
        stale = [g for g in self.finished if self.age(g, step) > self.threshold]
        if not stale:
            return [], []
        self.finished = [g for g in self.finished if self.age(g, step) <= self.threshold]
        self.ledger.evicted += len(stale)
        self.ledger.step_evicted_ages.extend(self.age(g, step) for g in stale)
        self.ledger.step_evicted_uids.extend(g.uid for g in stale)
        return stale, self.submit(len(stale), step)

    def required_uids(self, step: int) -> set[str]:
        """``wait``: the in-flight groups sampling has to wait for (age >= threshold at ``step``)."""
        if self.strategy != WAIT:
            return set()
        return {uid for uid, g in self.in_flight.items() if self.age(g, step) >= self.threshold}

    def ready(self, count: int, step: int) -> bool:
        """Can ``count`` groups be sampled at ``step``?"""
        return len(self.finished) >= count and not self.required_uids(step)

    def sample(self, count: int, step: int) -> list[PromptGroup]:
        """The ``count`` oldest finished groups (by submission step, then finishing order), removed."""
        if not self.ready(count, step):
            raise RuntimeError(f"replay buffer: expected {count} sampleable groups at step {step}, found "
                               f"{len(self.finished)} finished and {len(self.required_uids(step))} to wait for")
        order = sorted(self.finished, key=lambda g: (g.submit_step, g.finish_order))
        taken = order[:count]
        taken_ids = {g.uid for g in taken}
        self.finished = [g for g in self.finished if g.uid not in taken_ids]
        if self.strategy == DROP:
            worst = max(self.age(g, step) for g in taken)
            if worst > self.threshold:
                raise RuntimeError(f"replay buffer: sampled a group of age {worst} > threshold {self.threshold}")
        self.ledger.trained += count
        return taken

    def eviction_metrics(self) -> dict[str, float]:
        """verl's ``training/off_policy/evicted_samples`` (+ the evicted groups' age), since the last call."""
        ages = self.ledger.step_evicted_ages
        metrics = {"training/off_policy/evicted_samples": float(len(ages))}
        if ages:
            metrics.update({"training/off_policy/evicted_samples_staleness/mean": sum(ages) / len(ages),
                            "training/off_policy/evicted_samples_staleness/max": float(max(ages)),
                            "training/off_policy/evicted_samples_staleness/min": float(min(ages))})
        return metrics

    def end_step(self) -> None:
        """Forget the step's evictions (after its metrics and ledger line)."""
        self.ledger.step_evicted_ages, self.ledger.step_evicted_uids = [], []

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Finished groups whole; in-flight prompts by (index, epoch) only (they are reissued on resume)."""
        return {"stream": self.stream.state_dict(),
                "finished": [_group_state(g) for g in self.finished],
                "in_flight": [(g.index, g.epoch) for g in self.in_flight.values()],
                "ledger": dataclasses.asdict(self.ledger) | {"step_evicted_ages": [], "step_evicted_uids": []},
                "finish_order": self._finish_order}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Restore at global step ``step``: finished groups as they were; in-flight prompts reissued from the
        start, tagged ``step``."""
        self.stream.load_state_dict(state["stream"])
        self.finished = []
        for saved in state["finished"]:
            group = self.make_group(int(saved["index"]), int(saved["epoch"]), int(saved["submit_step"]))
            group.trajectories = [Trajectory(**t) for t in saved["trajectories"]]
            group.finish_order = int(saved["finish_order"])
            self.finished.append(group)
        self.in_flight = {}
        for index, epoch in state["in_flight"]:
            group = self.make_group(int(index), int(epoch), step)
            self.in_flight[group.uid] = group
        self.ledger = Ledger(**state["ledger"])
        self.ledger.reissued += len(state["in_flight"])
        self._finish_order = int(state["finish_order"])


def _group_state(group: PromptGroup) -> dict[str, Any]:
    """A finished group as JSON-able values (its prompt and fields are the dataset's, rebuilt on load)."""
    return {"index": group.index, "epoch": group.epoch, "submit_step": group.submit_step,
            "finish_order": group.finish_order, "trajectories": [dataclasses.asdict(t) for t in group.trajectories]}
