"""verl's agent loops on the SGLang rollout: a token-in/token-out ``server_manager`` over one SGLang engine.

Every turn of every trajectory is one ``async_generate`` request with the trajectory's token ids (prompt, the
model's earlier turns as sampled, the tool / user deltas) and its own ``max_new_tokens``. SGLang's scheduler
batches the requests in flight (continuous batching: a trajectory whose tool returns joins the running batch
at the next step), and its radix cache holds each trajectory's prefix between turns, so a turn prefills only
the tokens appended since the last one (``cached_tokens`` counts the reused ones). The agent loops run on the
engine's own event loop (the one SGLang's tokenizer manager is bound to): :meth:`SGLangTokenServer.run`.

Partial rollout (the V1 asynchronous trainers): :meth:`SGLangTokenServer.interrupt` aborts every running turn;
an interrupted turn's tokens and log-probs are kept and the turn resumes, on whatever weights the engine holds
then, when :meth:`SGLangTokenServer.resume_turns` is called (by the prompt + the tokens it has, the radix
cache's prefix again); the agent loop sees one turn whose log-probs are per token, each from the weights that
sampled it.

Import circle, on purpose: ``SGLangRollout.token_server`` builds this server (a lazy import at the call), and
the server uses the rollout module's error type and sampling-parameter mapping.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.engine.rollout.base import SamplingParams
from verl.engine.rollout.sglang_requests import SGLangRolloutError, sglang_sampling_params
from verl.engine.rollout.token_server import BaseTokenServer, turn_params, wait_at_gate

SEED_STRIDE = 7919  # a turn's sampling seed: base seed + stride x the turn's arrival index


class SGLangTokenServer(BaseTokenServer):
    """``await generate(request_id=, prompt_ids=, sampling_params=)`` -> ``{"token_ids", "log_probs",
    "stop_reason"}`` over an :class:`~verl.engine.rollout.sglang_rollout.SGLangRollout` (see the module doc).

    ``sampling_params``: verl's names, as the native engine's token server takes them (``temperature``,
    ``top_p``, ``top_k``, ``do_sample``, ``ignore_eos``, ``seed``, ``max_tokens``, ``stop_token_ids``,
    ``logprobs``); greedy log-probs are the raw log-softmax, sampled ones SGLang's (of the temperature-scaled
    distribution), as in the single-turn rollout. Counters: ``requests`` (turns served, resumed segments
    included), ``prompt_tokens`` and ``cached_tokens`` (of them, the ones SGLang's radix cache held)."""

    def __init__(self, rollout: Any, base: SamplingParams, pad_token_id: int):
        super().__init__(base, pad_token_id)
        self.rollout = rollout
        self._paused: asyncio.Event | None = None  # set: turns may run; cleared by interrupt()
        self._running: set[str] = set()           # SGLang rids of the turn segments in flight
        self.interruptible = True  # a turn is always resumable here (interrupt() aborts, resume_turns() goes on)
        # ``versions``: one per turn segment that added tokens. Weights change only while every turn is held
        # (interrupt(), then a push), so a segment's version is the one at its start.

    @property
    def calls(self) -> int:
        """The worker's ``agent_loop/engine_calls``: SGLang batches turns in its scheduler, so each turn is a
        request of its own (``turns_per_call`` 1)."""
        return self.requests

    @property
    def _engine(self) -> Any:
        return self.rollout.engine

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """SGLang's event loop: its tokenizer manager lives there, so every turn runs on it; an agent stream runs
        it on its own thread during a phase only (the engine's synchronous calls run it in between)."""
        return self._engine.loop

    @property
    def busy(self) -> bool:
        """A turn segment is in flight (after :meth:`interrupt`, False once every aborted one returned)."""
        return bool(self._running)

    def run(self, coroutine: Any) -> Any:
        """Run the agent loops' coroutine on SGLang's event loop (its tokenizer manager lives there)."""
        return self._engine.loop.run_until_complete(coroutine)

    # follow / release / close: the base's no-ops. Rollout TP > 1: SGLang's own processes are the group's ranks,
    # so the other trainer ranks have nothing to follow; the engine outlives the server.

    # ------------------------------------------------------------------ partial rollout
    def _gate(self) -> asyncio.Event:
        if self._paused is None:
            self._paused = asyncio.Event()
            self._paused.set()
        return self._paused

    def interrupt(self) -> int:
        """Abort every turn segment in flight (a weight sync is waiting); they resume at :meth:`resume_turns`.
        Call on the engine's loop. Returns how many were running."""
        self._gate().clear()
        running = list(self._running)
        for rid in running:
            self._engine.tokenizer_manager.abort_request(rid=rid)
        return len(running)

    def resume_turns(self) -> None:
        """Let the interrupted turns (and new ones) run again, on the weights the engine holds now."""
        self._gate().set()

    # ------------------------------------------------------------------ the agent loops' side
    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any],
                       **_: Any) -> dict[str, Any]:
        params, limit = turn_params(self.base, sampling_params, "the SGLang rollout")
        context = self.rollout.config.max_position_embeddings
        prompt = list(prompt_ids)
        limit = min(limit, context - len(prompt))
        tokens: list[int] = []
        log_probs: list[float] = []
        versions: list[int | None] = []
        stops = set(params.stop_ids)
        gate = self._gate()
        while True:
            left = limit - len(tokens)
            if left <= 0:  # the budget is spent (or the context was full from the start)
                return {"token_ids": tokens, "log_probs": log_probs, "stop_reason": "length", "versions": versions}
            await wait_at_gate(self, gate)
            version = self.version
            request = sglang_sampling_params(dataclasses.replace(params, response_length=left))
            if not params.greedy and params.seed is not None:  # reproducible, a new stream per turn segment
                request["sampling_seed"] = params.seed + SEED_STRIDE * self.requests
            rid = f"{request_id}-{self.requests}."  # SGLang aborts by rid prefix: no rid may prefix another
            self.requests += 1
            self._running.add(rid)
            try:
                out = await self._engine.async_generate(input_ids=prompt + tokens, sampling_params=request,
                                                        return_logprob=True, rid=rid)
            finally:
                self._running.discard(rid)
            meta = out.get("meta_info") or {}
            ids = list(out.get("output_ids") or [])[:left]  # none when aborted before it was scheduled
            pairs = meta.get("output_token_logprobs") or []
            if len(pairs) < len(ids) or [int(p[1]) for p in pairs[:len(ids)]] != ids:
                raise SGLangRolloutError(f"agent turn {rid}: logprob token ids disagree with output_ids")
            self.prompt_tokens += int(meta.get("prompt_tokens", len(prompt) + len(tokens)))
            self.cached_tokens += int(meta.get("cached_tokens", 0))
            tokens += ids
            log_probs += [float(p[0]) for p in pairs[:len(ids)]]
            if ids:
                versions.append(version)
            finish = (meta.get("finish_reason") or {}).get("type", "length")
            if finish == "abort":
                if gate.is_set():  # aborted by SGLang itself, not by interrupt()
                    raise SGLangRolloutError(f"agent turn {rid} was aborted by SGLang: {meta.get('finish_reason')}")
                self.interrupted += 1
                continue  # resumes on the new weights once resume_turns() is called
            done = "completed" if ids and ids[-1] in stops else "length"
            return {"token_ids": tokens, "log_probs": log_probs, "stop_reason": done, "versions": versions}
