"""The colocated asynchronous trainer's side of ``rollout.multi_turn``: agent trajectories in the replay buffer.

Each prompt group in flight is given to one rollout replica (round robin, in the order the groups were
submitted: the same on every rank), whose agent loops run its ``n`` trajectories across steps
(:mod:`verl.workers.agent_stream`). A step's generation is one phase: open on the weights of ``G - 1`` (starting
the groups submitted since the last phase), poll the replicas' finished trajectories into the buffer -- every
rank receives every replica's, so the buffer stays identical on all ranks -- until a batch can be sampled under
the staleness policy, then pause (the turns in the engine stop and wait for the next phase, on newer weights).

A trajectory keeps what the agent loop returned: its own prompt (the chat template with the tools' schemas,
which the dataset's ``raw_prompt_ids`` lack), its response with ``response_mask`` 0 on tool / user tokens, and
each sampled token's log-prob; its versions are the ones that sampled its tokens.
"""

from __future__ import annotations

import time
from typing import Any

from verl.single_controller.generation_wait import GenerationTimeoutError

# The dataset fields an agent loop reads, beside the replay buffer's prompt fields.
AGENT_FIELDS = ("raw_prompt", "agent_name", "tools_kwargs")
POLL_S = 0.1  # each rank waits this long for a finished trajectory before the ranks exchange theirs


class AgentPhases:
    """``rollout.multi_turn.enable`` under ``colocate_async`` (see the module doc), for a
    :class:`~verl.trainer.v1.colocate_async.ReplayBufferSource`."""

    def __init__(self, source: Any):
        self.source = source
        cfg = source.ctx.sections
        self.prompt_length = cfg.data.max_prompt_length
        self.response_length = cfg.data.max_response_length
        self.timeout = float(cfg.actor_rollout_ref.rollout.generation_timeout)
        self.started: set[str] = set()
        self._next_replica = 0

    def _start(self, groups: list[Any]) -> list[dict[str, Any]]:
        """The worker's view of the groups not yet started (each given the next replica)."""
        out = []
        for group in groups:
            if group.uid in self.started:
                continue
            self.started.add(group.uid)
            out.append({"uid": group.uid, "n": group.n, "replica": self._next_replica % self.source.rollout_dp,
                        "row": dict(group.fields)})
            self._next_replica += 1
        return out

    def run_until_ready(self, step: int) -> dict[str, float]:
        """One generation phase of step ``step`` (see the module doc); returns its metrics. A batch already
        sampleable opens no phase: one would only be cut at its first decode step (its prefill wasted)."""
        source, buffer = self.source, self.source.buffer
        wg = source.ctx.roles.actor_rollout_wg
        version = step - 1
        began = time.monotonic()
        metrics: dict[str, float] = {}
        opened, finished, polls = False, 0, 0
        self._evict(step, opened, version)
        while not buffer.ready(source.batch_groups, step):
            if not opened:
                metrics.update(wg.agent_open(self._start(list(buffer.in_flight.values())), version)[0])
                opened = True
            if time.monotonic() - began > self.timeout:
                raise GenerationTimeoutError(
                    f"colocate_async agent loops: {len(buffer.finished)} of the {source.batch_groups} groups a "
                    f"batch needs had finished after actor_rollout_ref.rollout.generation_timeout={self.timeout:g} "
                    f"s ({len(buffer.in_flight)} in flight)")
            records = [r for per_rank in wg.agent_poll(POLL_S) for r in per_rank]
            polls += 1
            for record in records:
                self._merge(record, version)
            finished += len(records)
            buffer.collect_finished()
            self._evict(step, opened, version)
        paused = wg.agent_pause()  # the rollout's memory back to training (and the engine held, if it ran)
        for key in ("agent_loop/engine_calls", "agent_loop/interrupted_turns", "agent_loop/held_turns"):
            metrics[key] = sum(m[key] for m in paused)
        metrics.update({"agent_loop/polls": float(polls), "agent_loop/finished_trajectories": float(finished),
                        "rollout/in_flight_groups": float(len(buffer.in_flight)),
                        "rollout/finished_groups": float(len(buffer.finished))})
        return metrics

    def _evict(self, step: int, opened: bool, version: int) -> None:
        """``drop``: the stale finished groups out; their replacements start now if the phase is open (otherwise
        when it opens)."""
        _, replacements = self.source.buffer.evict_stale(step)
        if replacements and opened:
            self.source.ctx.roles.actor_rollout_wg.agent_open(self._start(replacements), version)

    def _merge(self, record: Any, version: int) -> None:
        if record.error is not None:
            from verl.errors import InputError

            cls = InputError if getattr(record, "input_error", False) else RuntimeError
            raise cls(f"agent loop of trajectory {record.sample} of prompt group {record.uid}: {record.error}")
        group = self.source.buffer.in_flight.get(record.uid)
        if group is None:
            raise RuntimeError(f"agent loops: a finished trajectory of prompt group {record.uid}, which is not in "
                               "flight")
        record.into(group.trajectories[record.sample], self.prompt_length, self.response_length, version)
