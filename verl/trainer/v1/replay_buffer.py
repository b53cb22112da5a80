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
import glob
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from verl.engine.rollout.partial import GroupSample, PromptGroup
from verl.errors import InputError

DROP, WAIT = "drop", "wait"
STRATEGIES = (DROP, WAIT)
# The finished groups' trajectories in a checkpoint: tensors, sharded over the ranks that hold the buffer.
TRAJECTORY_DIR = "replay_buffer"
_SHARD = re.compile(r"shard(\d+)-of-(\d+)\.pt$")


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
            self._order = s.epoch_order(s.epoch)
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
        # Both strategies bound the age (wait: with the config's num_warmup_batches < threshold): past it is a bug.
        worst = max(self.age(g, step) for g in taken)
        if worst > self.threshold:
            raise RuntimeError(f"replay buffer ({self.strategy}): sampled a group of age {worst} > threshold "
                               f"{self.threshold}")
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
    def state_dict(self, trajectories_inline: bool = False) -> dict[str, Any]:
        """Finished groups (their trajectories inline, or written apart by :meth:`save_trajectories`: the
        checkpoint's JSON then stays small however long the responses); in-flight prompts by (index, epoch) only
        (they are reissued on resume)."""
        return {"stream": self.stream.state_dict(),
                "finished": [_group_state(g, trajectories_inline) for g in self.finished],
                "trajectories": "inline" if trajectories_inline else TRAJECTORY_DIR,
                "in_flight": [(g.index, g.epoch) for g in self.in_flight.values()],
                "ledger": dataclasses.asdict(self.ledger) | {"step_evicted_ages": [], "step_evicted_uids": []},
                "finish_order": self._finish_order}

    def save_trajectories(self, directory: str, rank: int, world: int) -> str | None:
        """Write the finished groups' trajectories under ``directory/replay_buffer``: shard ``rank`` of ``world``
        holds groups rank, rank + world, ... as flat tensors (ranks holding identical buffers split the writing;
        a buffer on one rank is written by it with world 1). Returns the file written, if any."""
        positions = list(range(rank, len(self.finished), world))
        trajectories = [t for i in positions for t in self.finished[i].trajectories]
        shard = {
            "positions": torch.tensor(positions, dtype=torch.int64),
            "group_sizes": torch.tensor([len(self.finished[i].trajectories) for i in positions], dtype=torch.int64),
            "token_lengths": torch.tensor([len(t.tokens) for t in trajectories], dtype=torch.int64),
            "tokens": torch.tensor([x for t in trajectories for x in t.tokens], dtype=torch.int64),
            "log_prob_lengths": torch.tensor([len(t.log_probs) for t in trajectories], dtype=torch.int64),
            # float64: the sampled log-probs come back bit for bit (a resumed step trains on the same numbers)
            "log_probs": torch.tensor([x for t in trajectories for x in t.log_probs], dtype=torch.float64),
            "finished": torch.tensor([t.finished for t in trajectories], dtype=torch.bool),
            "min_version": torch.tensor([_version(t.min_version) for t in trajectories], dtype=torch.int64),
            "max_version": torch.tensor([_version(t.max_version) for t in trajectories], dtype=torch.int64),
            "segments": torch.tensor([t.segments for t in trajectories], dtype=torch.int64),
            # agent trajectories: their masks and prompts (length -1: None, the default)
            "mask_lengths": torch.tensor([_length(t.mask) for t in trajectories], dtype=torch.int64),
            "masks": torch.tensor([x for t in trajectories for x in t.mask or ()], dtype=torch.int8),
            "prompt_lengths": torch.tensor([_length(t.prompt) for t in trajectories], dtype=torch.int64),
            "prompts": torch.tensor([x for t in trajectories for x in t.prompt or ()], dtype=torch.int64),
            # what agent loops returned for the reward (plain lists and dicts: torch.load's weights_only reads them)
            "agent_rewards": [t.agent_rewards for t in trajectories],
        }
        os.makedirs(os.path.join(directory, TRAJECTORY_DIR), exist_ok=True)
        path = os.path.join(directory, TRAJECTORY_DIR, f"shard{rank}-of-{world}.pt")
        torch.save(shard, path)
        return path

    @staticmethod
    def load_trajectories(directory: str) -> dict[int, list[GroupSample]]:
        """{finished group's position: its trajectories} from every shard under ``directory/replay_buffer``
        (written at any world size); a missing shard is a :class:`~verl.errors.InputError` naming it."""
        files = glob.glob(os.path.join(directory, TRAJECTORY_DIR, "shard*-of-*.pt"))
        shards = {int(m.group(1)): (int(m.group(2)), f) for f in files if (m := _SHARD.search(f))}
        worlds = {w for w, _ in shards.values()}
        if not shards or len(worlds) != 1 or sorted(shards) != list(range(next(iter(worlds)))):
            raise InputError(f"checkpoint {directory}: expected the replay buffer's shards shard<r>-of-<w>.pt for "
                             f"every r < w in {TRAJECTORY_DIR}/, found {sorted(os.path.basename(f) for f in files)}")
        out: dict[int, list[GroupSample]] = {}
        for _, path in shards.values():
            shard = torch.load(path, map_location="cpu", weights_only=True)
            tokens = iter(shard["tokens"].split(shard["token_lengths"].tolist()))
            log_probs = iter(shard["log_probs"].split(shard["log_prob_lengths"].tolist()))
            count = len(shard["finished"])
            masks = _optional_lists(shard, "mask_lengths", "masks", count)
            prompts = _optional_lists(shard, "prompt_lengths", "prompts", count)
            rewards = shard.get("agent_rewards") or [None] * count  # a shard written before the field: none
            fields = zip(shard["finished"].tolist(), shard["min_version"].tolist(), shard["max_version"].tolist(),
                         shard["segments"].tolist(), masks, prompts, rewards, strict=True)
            for position, size in zip(shard["positions"].tolist(), shard["group_sizes"].tolist(), strict=True):
                out[position] = [GroupSample(tokens=next(tokens).tolist(), log_probs=next(log_probs).tolist(),
                                            finished=f, min_version=_unversion(lo), max_version=_unversion(hi),
                                            segments=seg, mask=mask, prompt=prompt, agent_rewards=reward)
                                 for f, lo, hi, seg, mask, prompt, reward in (next(fields) for _ in range(size))]
        return out

    def load_state_dict(self, state: dict[str, Any], step: int,
                        trajectories: dict[int, list[GroupSample]] | None = None) -> None:
        """Restore at global step ``step``: finished groups as they were (their trajectories from the state, or
        ``trajectories`` read by :meth:`load_trajectories`); in-flight prompts reissued from the start, tagged
        ``step``."""
        self.stream.load_state_dict(state["stream"])
        self.finished = []
        for position, saved in enumerate(state["finished"]):
            group = self.make_group(int(saved["index"]), int(saved["epoch"]), int(saved["submit_step"]))
            if "trajectories" in saved:
                group.trajectories = [GroupSample(**t) for t in saved["trajectories"]]
            elif trajectories is not None and position in trajectories:
                group.trajectories = trajectories[position]
            else:
                raise InputError(f"checkpoint: expected the trajectories of the replay buffer's finished group "
                                 f"{group.uid} in its {TRAJECTORY_DIR}/ shards, found none")
            group.finish_order = int(saved["finish_order"])
            self.finished.append(group)
        self.in_flight = {}
        for index, epoch in state["in_flight"]:
            group = self.make_group(int(index), int(epoch), step)
            self.in_flight[group.uid] = group
        self.ledger = Ledger(**state["ledger"])
        self.ledger.reissued += len(state["in_flight"])
        self._finish_order = int(state["finish_order"])


def _group_state(group: PromptGroup, trajectories_inline: bool) -> dict[str, Any]:
    """A finished group as JSON-able values (its prompt and fields are the dataset's, rebuilt on load)."""
    state = {"index": group.index, "epoch": group.epoch, "submit_step": group.submit_step,
             "finish_order": group.finish_order}
    if trajectories_inline:
        state["trajectories"] = [dataclasses.asdict(t) for t in group.trajectories]
    return state


def _version(version: int | None) -> int:
    return -1 if version is None else int(version)


def _unversion(value: int) -> int | None:
    return None if value < 0 else value


def _length(values: list[int] | None) -> int:
    return -1 if values is None else len(values)


def _optional_lists(shard: dict[str, torch.Tensor], lengths_key: str, values_key: str,
                    count: int) -> list[list[int] | None]:
    """Per trajectory: its list (length >= 0) or None (-1); all None in a shard written before the field."""
    if lengths_key not in shard:
        return [None] * count
    lengths = shard[lengths_key].tolist()
    parts = iter(shard[values_key].split([max(n, 0) for n in lengths]))
    return [part.tolist() if n >= 0 else None for n, part in zip(lengths, parts, strict=True)]
