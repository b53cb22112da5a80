"""What every rollout engine's agent-loop token server provides (``BaseRollout.token_server``), and the helpers
the servers share.

A token server is verl's token-in/token-out ``server_manager``: the agent loops of
:mod:`verl.experimental.agent_loop` ``await generate(request_id=, prompt_ids=, sampling_params=)`` once per turn
and get ``{"token_ids", "log_probs", "stop_reason", "versions"}``. The worker (:mod:`verl.workers.agent_batch`)
and the agent stream of the asynchronous trainers (:mod:`verl.workers.agent_stream`) drive it through the methods
below only. The servers: :mod:`verl.engine.rollout.native.token_server`,
:mod:`verl.engine.rollout.sglang_token_server`.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.engine.rollout.base import RolloutInputError, SamplingParams


class BaseTokenServer(abc.ABC):
    """One rollout replica's token server. Counters the worker reports: ``calls`` (engine calls), ``requests``
    (turns served), ``prompt_tokens`` / ``cached_tokens`` (the turns' prompt tokens, and those a prefix cache
    held), ``interrupted`` (turn segments cut by :meth:`interrupt`), ``parked`` (turns held at the gate).
    ``version``: the model version of the weights the engine holds (None: untracked); each turn reports the
    versions that sampled it. ``interruptible``: turns may be cut and resumed (the asynchronous trainers)."""

    def __init__(self, base: SamplingParams, pad_token_id: int):
        self.base = dataclasses.replace(base, n=1)
        self.pad_token_id = pad_token_id
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.interrupted = 0
        self.parked = 0
        self.interruptible = False
        self.version: int | None = None

    @property
    @abc.abstractmethod
    def calls(self) -> int:
        """Engine calls made (``agent_loop/engine_calls``)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop every turn must run on (an engine bound to its own loop); None: any loop."""
        return None

    @property
    @abc.abstractmethod
    def busy(self) -> bool:
        """A turn is in flight on the engine (after :meth:`interrupt`, False once the cut ones returned)."""

    @abc.abstractmethod
    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any],
                       **_: Any) -> dict[str, Any]:
        """One turn: the trajectory's tokens so far -> the tokens sampled, their log-probs, why it stopped."""

    @abc.abstractmethod
    def run(self, coroutine: Any) -> Any:
        """Run the agent loops' coroutine to its end on the loop the server needs."""

    @abc.abstractmethod
    def interrupt(self) -> Any:
        """Cut the turns in flight and hold every turn until :meth:`resume_turns` (a weight sync is waiting)."""

    @abc.abstractmethod
    def resume_turns(self) -> None:
        """Let the held turns go on, on the weights the engine holds now."""

    def follow(self) -> dict | None:
        """Rollout TP > 1, the group's other ranks: run the calls rank 0 makes until it closes (None) or releases
        them (its marker). Default: nothing to follow (the engine's own processes are the group's ranks)."""
        return None

    def release(self, marker: dict) -> None:  # noqa: B027 - optional: a no-op by default
        """Rank 0, between engine calls: let the followers out of :meth:`follow` with ``marker``."""

    def drop_prefix_cache(self) -> None:  # noqa: B027 - optional: a no-op by default
        """Free K/V kept across turns (the weights are about to change)."""

    def close(self) -> None:  # noqa: B027 - optional: a no-op by default
        """Rank 0: the loops are done (followers released, kept K/V freed)."""


_REQUEST_KEYS = ("temperature", "top_p", "top_k", "do_sample", "ignore_eos", "seed")


async def wait_at_gate(server: Any, gate: asyncio.Event) -> None:
    """A turn held while a weight sync runs (``gate`` cleared by ``interrupt``): counted in ``server.parked`` until
    ``resume_turns`` opens the gate again. Every token server holds its turns here."""
    if gate.is_set():
        return
    server.parked += 1
    try:
        await gate.wait()
    finally:
        server.parked -= 1


def turn_params(base: SamplingParams, sampling_params: Mapping[str, Any],
                engine: str = "the native engine") -> tuple[SamplingParams, int]:
    """One agent-loop turn's request (verl's names) over a replica's ``base`` params -> (its SamplingParams with
    ``response_length`` 1, its token budget ``max_tokens``): ``stop_token_ids`` merged with the base's,
    ``logprobs`` accepted (log-probs always come back), ``repetition_penalty`` other than 1 and unknown keys
    refused (one line)."""
    sp = dict(sampling_params)
    penalty = sp.pop("repetition_penalty", 1.0)
    if penalty not in (None, 1, 1.0):
        raise RolloutInputError(f"repetition_penalty={penalty}: {engine} samples without a penalty here")
    sp.pop("logprobs", None)
    limit = int(sp.pop("max_tokens", base.response_length))
    stops = set(base.stop_token_ids) | set(sp.pop("stop_token_ids", None) or ())
    unknown = sorted(set(sp) - set(_REQUEST_KEYS))
    if unknown:
        raise RolloutInputError(f"sampling_params: expected keys among {sorted(_REQUEST_KEYS)} + max_tokens, "
                                f"stop_token_ids, logprobs, repetition_penalty; found {unknown}")
    return dataclasses.replace(base, n=1, stop_token_ids=tuple(sorted(stops)), response_length=1, **sp), limit
