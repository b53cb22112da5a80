"""Agent loops that live across training steps: ``rollout.multi_turn`` under verl's V1 asynchronous trainers.

The sync trainer runs a batch's agent loops to their end inside one generation call (:mod:`.agent_batch`). The
asynchronous trainers keep them going from step to step instead: each rollout replica runs its trajectories as
asyncio tasks on an event loop thread, over the engine's interruptible token server. A generation *phase* opens the
server on the weights of one version (:meth:`AgentStream.open`); finished trajectories are polled
(:meth:`AgentStream.poll`); the phase ends at :meth:`AgentStream.pause`: the engine call in flight stops after
its decode step, and the turn it cut keeps its tokens and log-probs and waits, with every new turn, for the next
phase, where it goes on from its prompt + the tokens it has on the newer weights (partial rollout). Only the
engine is held, so the trainer can take the rollout's memory back.

* ``colocate_async``: a phase is a step's generation on the training ranks (:mod:`verl.trainer.v1.agent_phases`);
  under rollout TP a replica's other ranks follow its engine calls (:class:`AgentFollower`).
* ``separate_async``: a standalone pool's replica is always in a phase but while it takes a command (a weight
  sync, validation): :func:`serve_pool_agents`.

A finished trajectory carries the model versions that sampled its tokens (the token server's ``versions``, one
per engine call that added tokens): verl's ``min_global_steps`` / ``max_global_steps`` of a trajectory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from verl.errors import InputError
from verl.utils.logging_utils import get_logger
from verl.workers.agent_batch import loop_sampling

logger = get_logger(__name__)

PAUSE_WAIT_S = 120.0  # an engine call stops after its current decode step: far less than this


@dataclasses.dataclass
class FinishedTrajectory:
    """One trajectory as the trainer's replay buffer takes it (picklable: it is gathered over the ranks)."""

    uid: str
    sample: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    versions: list[int]              # the model versions that sampled its tokens, in order
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    agent_rewards: dict[str, Any] | None = None  # what the loop returned for the reward (GroupSample.agent_rewards)
    error: str | None = None         # the agent loop raised: the trainer ends the job with it
    input_error: bool = False        # ... an InputError (the loop's own output refused): exit 2, not 1

    def into(self, traj: Any, prompt_length: int, response_length: int, version: int) -> None:
        """Write this finished trajectory into the replay buffer's ``traj`` (a
        :class:`~verl.engine.rollout.partial.GroupSample`): the response cut to ``response_length``, its own prompt
        left-truncated to ``prompt_length`` (as the sync rollout's), ``version`` when no engine call reported one."""
        n = min(len(self.response_ids), response_length)
        traj.tokens = list(self.response_ids[:n])
        traj.log_probs = [float(x) for x in self.response_logprobs[:n]]
        traj.mask = [int(x) for x in self.response_mask[:n]]
        traj.prompt = list(self.prompt_ids[-prompt_length:])
        versions = self.versions or [version]
        traj.min_version, traj.max_version = min(versions), max(versions)
        traj.segments = len(set(versions))
        traj.turns = (self.num_turns, self.tool_calls, self.tool_errors)
        traj.agent_rewards = self.agent_rewards
        traj.finished = True


def agent_metrics(groups: list[Any]) -> dict[str, float]:
    """verl's ``num_turns/*``, ``tool_call_counts/*`` and ``tool_call_errors/*`` over the trajectories of a trained
    batch's prompt groups (those restored from a checkpoint carry none: the figures are over the others)."""
    counts = [t.turns for group in groups for t in group.trajectories if t.turns is not None]
    metrics: dict[str, float] = {}
    for i, name in enumerate(("num_turns", "tool_call_counts", "tool_call_errors")):
        values = [c[i] for c in counts]
        if values:
            metrics.update({f"{name}/min": float(min(values)), f"{name}/max": float(max(values)),
                            f"{name}/mean": float(sum(values) / len(values))})
    return metrics


class _VersionedServer:
    """A trajectory's view of the token server: what the agent loop calls, recording the versions of its turns."""

    def __init__(self, server: Any):
        self.server = server
        self.versions: list[int] = []

    async def generate(self, **kwargs: Any) -> Any:
        out = await self.server.generate(**kwargs)
        self.versions.extend(v for v in out.get("versions", ()) if v is not None)
        return out


class AgentStreamInputError(InputError):
    """A trajectory the async trainer cannot train on as it is (its agent loop's output lacks what it needs)."""


def refuse_unscored_tokens(out: Any, agent_name: str) -> None:
    """The async trainer keeps each sampled token's rollout log-prob (the old policy's under
    ``rollout_correction.bypass_mode``, the behaviour policy's for the staleness correction): one line for a loop
    that returned none for its sampled tokens (they were 0.0 before: a probability of 1)."""
    sampled = sum(1 for m in out.response_mask if m)
    if out.response_logprobs is None and sampled:
        raise AgentStreamInputError(
            f"agent loop {agent_name!r}: expected AgentLoopOutput.response_logprobs for its {sampled} sampled tokens "
            f"(the async trainer's rollout log-probs), found none: return the server's log_probs")


class AgentStream:
    """One rollout replica's agent loops across generation phases (see the module doc). ``runner``: an
    :class:`~verl.experimental.agent_loop.AgentLoopRunner` over ``server`` (an interruptible token server).

    The loops' event loop: the native engine's server works on any loop, so the stream keeps one of its own
    running across phases (a tool call goes on between them). SGLang's server must run on SGLang's loop (its
    ``loop``: the tokenizer manager lives there), which the engine's synchronous calls (a weight push, a memory
    release, validation) also run; the stream runs it on its thread during a phase only, so between phases the
    loops, their tool calls included, wait with it."""

    def __init__(self, runner: Any, server: Any, sampling: Mapping[str, Any]):
        self.runner, self.server, self.sampling = runner, server, dict(sampling)
        server.interruptible = True
        self._engine_loop = server.loop
        self.loop = self._engine_loop or asyncio.new_event_loop()
        self.thread: threading.Thread | None = None
        self._finished: queue.Queue[FinishedTrajectory] = queue.Queue()
        self._tasks: dict[tuple[str, int], Any] = {}
        self._seen = (0, 0)  # the server's engine calls and interrupted turns at the last pause
        self._open = False
        self._run_loop()
        self._call(self._hold())  # closed until the first phase opens
        self._park_loop()

    @classmethod
    def over(cls, server: Any, config: Any, tokenizer: Any, params: Any) -> AgentStream:
        """A stream of the configured agent loops (``config``: the ``actor_rollout_ref`` section, its tools and
        custom loops) over ``server``, each turn sampled with the replica's ``params``."""
        from verl.experimental.agent_loop import AgentLoopRunner

        runner = AgentLoopRunner({"actor_rollout_ref": config}, server, tokenizer)
        return cls(runner, server, loop_sampling(params))

    # ------------------------------------------------------------------ the trainer's side (its thread)
    def open(self, version: int, groups: list[Mapping[str, Any]]) -> None:
        """A phase on the weights of ``version``: start the trajectories of ``groups`` (``uid``, ``n``, ``row``:
        the dataset row an agent loop takes) and let every held turn go on."""
        self._run_loop()
        self.server.version = version
        self._open = True
        for group in groups:
            for sample in range(int(group["n"])):
                key = (str(group["uid"]), sample)
                if key in self._tasks:
                    raise RuntimeError(f"agent stream: trajectory {key} started twice")
                self._tasks[key] = asyncio.run_coroutine_threadsafe(self._trajectory(key, group["row"]), self.loop)
        self._call(self._resume())

    def poll(self, wait_s: float) -> list[FinishedTrajectory]:
        """The trajectories finished since the last poll, waiting up to ``wait_s`` for the first one."""
        out: list[FinishedTrajectory] = []
        try:
            out.append(self._finished.get(timeout=wait_s) if wait_s > 0 else self._finished.get_nowait())
            while True:
                out.append(self._finished.get_nowait())
        except queue.Empty:
            pass
        for record in out:
            self._tasks.pop((record.uid, record.sample), None)
        return out

    def pause(self, marker: dict | None = None) -> dict[str, float]:
        """End the phase: the engine call in flight stops after its decode step; returns once the engine is idle
        (the trainer may then take its memory). Under rollout TP the replica's other ranks, which followed the
        phase's engine calls, are released with ``marker`` (what they are to do next; default: pause too).
        Metrics: the phase's engine calls and the turns held."""
        if self.thread is not None:
            self._call(self._hold())
            self._call(self._idle(), timeout=PAUSE_WAIT_S)
            self._park_loop()
        if self._open:
            self.server.release(marker or {"op": "pause"})
            self._open = False
        calls, cut = self.server.calls - self._seen[0], self.server.interrupted - self._seen[1]
        self._seen = (self.server.calls, self.server.interrupted)
        return {"agent_loop/engine_calls": float(calls), "agent_loop/interrupted_turns": float(cut),
                "agent_loop/held_turns": float(self.server.parked), "agent_loop/in_flight": float(len(self._tasks))}

    def close(self) -> None:
        """Cancel the running trajectories and stop the loop (the worker's shutdown)."""
        for future in self._tasks.values():
            future.cancel()
        self._tasks.clear()
        if self._engine_loop is None:
            self._stop_loop()

    # ------------------------------------------------------------------ the loop's thread
    def _run_loop(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.loop.run_forever, name="agent-stream", daemon=True)
            self.thread.start()

    def _park_loop(self) -> None:
        """Between phases, SGLang's loop goes back to the engine's synchronous calls (its own loop runs on)."""
        if self._engine_loop is not None:
            self._stop_loop()

    def _stop_loop(self) -> None:
        if self.thread is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(timeout=10)
            if self.thread.is_alive():
                raise RuntimeError("agent stream: the agent loops' event loop did not stop within 10 s")
        self.thread = None

    def _call(self, coroutine: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    # ------------------------------------------------------------------ on the loop
    async def _hold(self) -> None:
        self.server.interrupt()

    async def _resume(self) -> None:
        self.server.resume_turns()

    async def _idle(self) -> None:
        while self.server.busy:
            await asyncio.sleep(0.002)
        for _ in range(3):  # the cut turns take their results and go back to the gate (counted, held)
            await asyncio.sleep(0)

    async def _trajectory(self, key: tuple[str, int], row: Mapping[str, Any]) -> None:
        uid, sample = key
        server = _VersionedServer(self.server)
        from verl.experimental.agent_loop.runner import agent_rewards

        try:
            out = await self.runner.run_one(row, self.sampling, server_manager=server)
            refuse_unscored_tokens(out, str(row.get("agent_name") or self.runner.default_agent_loop))
            logprobs = out.response_logprobs if out.response_logprobs is not None else [0.0] * len(out.response_ids)
            record = FinishedTrajectory(
                uid, sample, list(out.prompt_ids), list(out.response_ids), list(out.response_mask), list(logprobs),
                server.versions, num_turns=int(out.num_turns),
                tool_calls=int(out.extra_fields.get("tool_call_counts", 0)),
                tool_errors=int(out.extra_fields.get("tool_call_errors", 0)), agent_rewards=agent_rewards(out))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - every error ends the job, on the trainer's thread
            logger.exception("agent stream: trajectory %s of group %s failed", sample, uid)
            record = FinishedTrajectory(uid, sample, [], [], [], [], server.versions,
                                        error=f"{type(err).__name__}: {err}", input_error=isinstance(err, InputError))
        self._finished.put(record)



class AgentFollower:
    """A rollout replica's other TP ranks under colocate_async: the replica's rank 0 runs the agent loops and the
    tools (:class:`AgentStream`); this rank runs each of its engine calls (:meth:`TokenServer.follow`) on a thread
    of its own while a phase is open, beside this rank's share of the trainer's polls, until rank 0 releases it
    at the phase's end. The same methods as :class:`AgentStream`: its trajectories are rank 0's."""

    def __init__(self, server: Any):
        self.server = server
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def open(self, version: int, groups: list[Mapping[str, Any]]) -> None:
        if self._thread is not None:  # more groups started in an open phase (the replacements of evicted ones)
            return
        self._thread = threading.Thread(target=self._follow, name="agent-follow", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            self.server.follow()
        except BaseException as err:  # noqa: BLE001 - raised on the trainer's thread at the pause
            self._error = err

    def poll(self, wait_s: float) -> list[FinishedTrajectory]:
        return []

    def pause(self, marker: dict | None = None) -> dict[str, float]:
        if self._thread is not None:
            self._thread.join(timeout=PAUSE_WAIT_S)
            if self._thread.is_alive():
                raise RuntimeError(f"agent stream: the replica's rank 0 had not ended its phase after {PAUSE_WAIT_S:g} "
                                   "s (this rollout TP rank still follows its engine calls)")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"agent stream: following rank 0's engine calls failed: {error}") from error
        return {"agent_loop/engine_calls": 0.0, "agent_loop/interrupted_turns": 0.0, "agent_loop/held_turns": 0.0,
                "agent_loop/in_flight": 0.0}

    def close(self) -> None:
        """Nothing to stop: a phase always ends with a pause, which joins the thread."""


# ---------------------------------------------------------------------- a standalone pool's replica (separate_async)
POOL_POLL_S = 0.02  # how often a pool replica looks for the controller's commands and finished trajectories


def serve_pool_agents(start: Mapping[str, Any], engine: Any, commands: queue.Queue, send: Callable[[dict], None], *,
                      sync: Callable[[dict], None], generate: Callable[[dict], None], replica: int, tp_rank: int,
                      config: Any, tokenizer: Any, prompt_length: int, response_length: int) -> int:
    """``rollout.multi_turn`` under ``separate_async``: one pool replica's agent loops, streaming across weight
    syncs. The controller's ``submit`` starts each prompt group's ``n`` trajectories at once; a group whose every
    trajectory finished goes back to training rank 0 (``send``) as the segments' groups do. ``sync`` pauses the
    loops (the engine call in flight stops after its decode step), takes the new weights and lets the cut turns
    go on, on them (partial rollout: each token's log-prob is from the weights that sampled it); ``generate``
    (validation) runs between the same pause and resume. A running tool call goes on through both.

    Rollout TP > 1: the replica's rank 0 runs the loops and the tools; the other ranks follow its engine calls,
    and at each command rank 0 releases them (:meth:`TokenServer.release`) to take the same command.
    ``start``: the controller's ``stream`` command (``params``, ``seed``, ``version``); ``commands``: the queue
    the controller's commands arrive in; ``config``: the ``actor_rollout_ref`` section."""
    params = dataclasses.replace(start["params"], seed=int(start["seed"]))
    server = engine.token_server(params, engine.pad_token_id)
    if tp_rank != 0:
        return _follow_pool_agents(server, commands, sync, generate)
    stream = AgentStream.over(server, config, tokenizer, params)
    version = start.get("version")
    stream.open(version, [])
    in_flight: dict[str, Any] = {}  # uid -> the prompt group (its trajectories filled as they finish)
    try:
        while True:
            try:
                command = commands.get(timeout=POOL_POLL_S)
            except queue.Empty:
                command = None
            if command is not None:
                op = command["op"]
                if op == "submit":
                    for group in command["groups"]:
                        in_flight[group.uid] = group
                    stream.open(version, [{"uid": g.uid, "n": g.n, "row": dict(g.fields)} for g in command["groups"]])
                elif op in ("sync", "generate", "stop"):
                    stream.pause({"op": op})  # the TP followers are released to take the same command
                    if op == "stop":
                        send({"op": "stopped", "replica": replica, "groups": []})
                        return 0
                    began = time.time()
                    if op == "sync":
                        sync(command)
                        version = command["version"] if command.get("version") is not None else (version or 0) + 1
                        send({"op": "synced", "replica": replica, "groups": [],
                              "span": ("update_weights", began, time.time())})
                    else:
                        generate(command)
                    stream.open(version, [])
                else:
                    raise RuntimeError(f"rollout pool: expected a command submit/sync/generate/stop, found {op!r}")
            finished, error = [], None
            for record in stream.poll(0):
                if record.error is not None:
                    error = f"agent loop of trajectory {record.sample} of prompt group {record.uid}: {record.error}"
                    continue
                group = in_flight[record.uid]
                record.into(group.trajectories[record.sample], prompt_length, response_length, version)
                if group.finished:
                    finished.append(in_flight.pop(record.uid))
            if finished or error:  # the trainer ends the job with an agent loop's error
                send({"op": "finished", "replica": replica, "groups": finished, "error": error,
                      "metrics": {"agent_loop/finished_trajectories": float(sum(g.n for g in finished))}})
    finally:
        stream.close()


def _follow_pool_agents(server: Any, commands: queue.Queue, sync: Callable[[dict], None],
                        generate: Callable[[dict], None]) -> int:
    """A pool replica's other TP ranks: follow rank 0's engine calls; at each release take the same command
    (the submits, which only rank 0 acts on, are skipped)."""
    while True:
        marker = server.follow()  # native: at rank 0's release; SGLang: at once (its own processes are the group)
        command = commands.get()
        while command["op"] == "submit":
            command = commands.get()
        if marker is not None and command["op"] != marker["op"]:
            raise RuntimeError(f"rollout pool: the replica's rank 0 took {marker['op']!r}, this rank's next command "
                               f"is {command['op']!r}")
        if command["op"] == "stop":
            return 0
        (sync if command["op"] == "sync" else generate)(command)
