"""The native engine's agent-loop token server: turns of many trajectories batched into one engine call, K/V kept
across a trajectory's turns, and turns cut and resumed across weight syncs (see :class:`TokenServer`). vLLM's engine
uses it too (its ``generate_responses`` takes the same per-row ``limits`` and ``stop`` rule; ``prefix_caching``
False: vLLM keeps the prefixes itself)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from verl.engine.rollout.base import SamplingParams, check_prompts
from verl.engine.rollout.native.prefix_cache import PrefixCache
from verl.engine.rollout.partial import SegmentStop
from verl.engine.rollout.token_server import BaseTokenServer, turn_params, wait_at_gate


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    limit: int
    params: SamplingParams
    future: asyncio.Future
    key: str  # the trajectory's request_id: its kept K/V


def prefix_budget(rollout: Any) -> int:
    """The prefix cache's budget in tokens: the engine's ``prefix_cache_tokens`` (the registry sets one full
    batch's KV: max rows x max sequence length), else what 1 GiB of the whole model's K/V holds."""
    if rollout.prefix_cache_tokens is not None:
        return int(rollout.prefix_cache_tokens)
    c = rollout.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * rollout.kv_cache.dtype.itemsize
    return max(1, 2**30 // per_token)


class TokenServer(BaseTokenServer):
    """verl's token-in/token-out ``server_manager`` over one native engine (one rollout replica): ``await
    generate(request_id=, prompt_ids=, sampling_params=)`` -> ``{"token_ids", "log_probs", "stop_reason"}``, what
    the agent loops of ``verl.experimental.agent_loop`` call once per turn.

    Batching: requests that arrive while the engine is busy (one per trajectory turn) wait and then run together
    as one ``generate_responses`` call, left-padded, each row with its own token budget (``limits``), so many
    trajectories share each decode step while the others run their tools. The engine call runs in a worker
    thread: tools (coroutines, sandbox subprocesses) go on meanwhile.

    ``sampling_params``: verl's names (``temperature``, ``top_p``, ``top_k``, ``do_sample``, ``ignore_eos``,
    ``seed``) over the replica's ``base`` params, ``max_tokens`` (this turn's budget, the engine's
    ``response_length``), ``stop_token_ids`` merged with the base's; ``logprobs`` is accepted (the log-probs always
    come back: ``log_softmax(logits / temperature)`` at the sampled token, what the actor recomputes);
    ``repetition_penalty`` other than 1 is refused. Requests whose parameters differ run in separate calls.

    KV cache across turns (``rollout.enable_prefix_caching``, verl's key; on by default): after each call the K/V
    of every token a trajectory fed (its prompt and sampled tokens) is kept under its ``request_id``
    (:class:`~verl.engine.rollout.native.prefix_cache.PrefixCache`, at most ``prefix_cache_tokens`` tokens, least
    recently used out first); its next turn's prompt starts with them, so the call copies them into its cache
    slots and prefills only from the first column some row of the batch has no K/V for (rows are left-padded to
    one width, so a row appended to more than the others sets where the prefill starts). ``prompt_tokens`` /
    ``cached_tokens``: the turns' prompt tokens, and those not computed again. Kept K/V is dropped when the
    weights may change (an :meth:`interrupt`, a new ``version``) and at :meth:`drop_prefix_cache`.

    Rollout TP > 1: only the group's rank 0 runs the agent loops and this server; every engine call's inputs are
    broadcast to the other ranks of the group first, which run the same call in :meth:`follow` (the tools run
    once, and every rank decodes exactly the same batch; rank 0's choice of kept K/V goes with the inputs, and each
    rank keeps its own heads'). :meth:`close` ends the followers' loop.

    Partial rollout (``interruptible``; the V1 asynchronous trainers): :meth:`interrupt` (any thread) stops the
    engine call in flight after its current decode step; a turn it cut keeps its tokens and log-probs and waits,
    with every new turn, until :meth:`resume_turns`, then goes on from its prompt + the tokens it has, on the
    weights the engine holds then. The agent loop sees one turn; each token's log-prob is from the weights that
    sampled it. ``parked``: turns waiting for ``resume_turns``.
    """

    def __init__(self, rollout: Any, base: SamplingParams, pad_token_id: int):
        # rollout: the NativeRollout this server batches turns into (not imported: it builds this server)
        super().__init__(base, pad_token_id)
        self.rollout = rollout
        self._calls = 0  # engine calls made (batched turns)
        self._pending: list[_Request] = []
        self._driver: asyncio.Task | None = None
        self._abort = False     # read by the engine thread's stop rule
        self._gate: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # ``versions``: one per engine call that added tokens to the turn
        self.prefix = PrefixCache(prefix_budget(rollout)) if rollout.prefix_caching else None
        self._prefix_version: int | None = None
        self._drop_prefix = False  # an interrupt: the weights may change before the next call

    @property
    def calls(self) -> int:
        return self._calls

    # ------------------------------------------------------------------ the agent loops' side
    def request_params(self, sampling_params: Mapping[str, Any]) -> tuple[SamplingParams, int]:
        """(the engine's params for one turn, its token budget) from a request's verl-named params."""
        return turn_params(self.base, sampling_params)

    def run(self, coroutine: Any) -> Any:
        """Run the agent loops' coroutine to its end (the worker's entry; SGLang's server runs it on its loop)."""
        return asyncio.run(coroutine)

    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any],
                       **_: Any) -> dict[str, Any]:
        params, limit = self.request_params(sampling_params)
        if len(prompt_ids) >= self.rollout.config.max_position_embeddings or limit <= 0:
            return {"token_ids": [], "log_probs": [], "stop_reason": "length"}  # the context is full
        tokens: list[int] = []
        log_probs: list[float] = []
        versions: list[int | None] = []
        while True:
            await wait_at_gate(self, self._ensure_gate())
            request = _Request(list(prompt_ids) + tokens, limit - len(tokens), params,
                               asyncio.get_running_loop().create_future(), str(request_id))
            self._pending.append(request)
            if self._driver is None:
                self._driver = asyncio.ensure_future(self._drive())
            result = await request.future
            tokens += result["token_ids"]
            log_probs += result["log_probs"]
            if result["token_ids"]:
                versions.append(result.pop("version"))
            if not result.pop("interrupted", False):
                result.pop("version", None)
                return {**result, "token_ids": tokens, "log_probs": log_probs, "versions": versions}
            self.interrupted += 1  # goes on once resume_turns() opens the gate

    # ------------------------------------------------------------------ partial rollout
    def _ensure_gate(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._gate is None or self._loop is not loop:
            self._gate, self._loop = asyncio.Event(), loop
            if not self._abort:
                self._gate.set()
        return self._gate

    def interrupt(self) -> None:
        """Stop the engine call in flight after its decode step and hold every turn until :meth:`resume_turns`
        (callable from any thread: the flag is read by the engine thread, the gate closed on the loop). The kept
        K/V goes at the next call: the weights may change meanwhile."""
        self._abort = True
        self._drop_prefix = True
        if self._loop is None or self._gate is None or self._loop.is_closed():
            return  # the gate is made closed (on the next loop)
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._gate.clear()
        else:
            self._loop.call_soon_threadsafe(self._gate.clear)

    def resume_turns(self) -> None:
        """Let the held turns go on (call on the loop), on the weights the engine holds now."""
        self._abort = False
        if self._gate is not None:
            self._gate.set()

    @property
    def busy(self) -> bool:
        """An engine call is in flight or queued (after :meth:`interrupt`, False once the cut call returned)."""
        return self._driver is not None

    async def _drive(self) -> None:
        try:
            while self._pending:
                await asyncio.sleep(0)  # every trajectory ready to ask joins this call
                pending, self._pending = self._pending, []
                groups: dict[SamplingParams, list[_Request]] = {}
                for request in pending:
                    groups.setdefault(request.params, []).append(request)
                for params, requests in groups.items():
                    try:
                        results = await asyncio.to_thread(self._run, params, requests)
                    except Exception as err:  # every waiting turn sees the engine's error
                        for request in requests:
                            if not request.future.done():
                                request.future.set_exception(err)
                        continue
                    for request, result in zip(requests, results, strict=True):
                        if not request.future.done():
                            request.future.set_result(result)
        finally:
            self._driver = None

    def _run(self, params: SamplingParams, requests: list[_Request]) -> list[dict[str, Any]]:
        context = self.rollout.config.max_position_embeddings
        rows = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.int64)
        attention = torch.zeros((rows, width), dtype=torch.int64)
        # A turn never runs past the model's context: its budget shrinks to what is left (>= 1, see generate).
        limits = torch.tensor([min(r.limit, context - len(r.prompt_ids)) for r in requests])
        for i, r in enumerate(requests):
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.int64)
            attention[i, width - len(r.prompt_ids):] = 1
        steps = int(limits.max())
        if params.seed is not None:  # reproducible, and a new stream each call
            params = dataclasses.replace(params, seed=params.seed + 7919 * self._calls)
        params = dataclasses.replace(params, response_length=steps)
        # Each row fits the context by its own budget; the batch's longest prompt + longest budget may not.
        check_prompts(input_ids, attention, self.rollout.config.vocab_size, width + steps, steps)
        self._calls += 1
        self.requests += rows
        interruptible = self.interruptible
        plan = self._prefix_plan(requests)
        if self.rollout.tp_size > 1:
            dist.broadcast_object_list([(input_ids, attention, params, limits, interruptible, plan)],
                                       group=self.rollout.tp_group, group_src=0)
        stop = _interrupt_rule(rows, lambda: self._abort) if interruptible else None
        responses, mask, log_probs = self._generate(input_ids, attention, params, limits, stop, plan)
        self.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        if plan is not None:  # the prefill started at column `start`: each row's real tokens before it were kept
            start = width - self.rollout.prefilled_tokens // rows
            self.cached_tokens += int((start - (width - attention.sum(-1))).clamp(min=0).sum())
        stops = set(params.stop_ids)
        out = []
        for i in range(rows):
            n = int(mask[i].sum())
            ids = responses[i, :n].tolist()
            stopped = bool(ids) and ids[-1] in stops
            out.append({"token_ids": ids, "log_probs": log_probs[i, :n].tolist(),
                        "stop_reason": "completed" if stopped else "length",
                        # cut by interrupt(): neither a stop token nor the turn's budget ended it
                        "interrupted": interruptible and not stopped and n < int(limits[i]),
                        "version": self.version})
        return out

    # ------------------------------------------------------------------ K/V kept across turns
    def _prefix_plan(self, requests: list[_Request]) -> tuple[bool, list[tuple[str, int]]] | None:
        """Rank 0: (drop what is kept first?, per row its key and how many leading prompt tokens have kept K/V);
        None without prefix caching. Always leaves a row's last prompt token to compute (its logits)."""
        if self.prefix is None:
            return None
        clear = self._drop_prefix or self.version != self._prefix_version
        if clear:
            self._drop_prefix, self._prefix_version = False, self.version
            self.prefix.clear()
        return clear, [(r.key, min(self.prefix.match(r.key, r.prompt_ids), len(r.prompt_ids) - 1)) for r in requests]

    def _generate(self, input_ids: torch.Tensor, attention: torch.Tensor, params: SamplingParams,
                  limits: torch.Tensor, stop: SegmentStop | None,
                  plan: tuple[bool, list[tuple[str, int]]] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The engine call (every rank of the group, the same ``plan``), then each row's fed tokens kept."""
        if plan is None:
            return self.rollout.generate_responses(input_ids, attention, params, self.pad_token_id, limits=limits,
                                                   stop=stop)
        clear, rows = plan
        if clear:
            self.prefix.clear()
        prefix_kv = [self.prefix.get(key, c) if c else None for key, c in rows]
        try:
            responses, mask, log_probs = self.rollout.generate_responses(
                input_ids, attention, params, self.pad_token_id, limits=limits, stop=stop, prefix_kv=prefix_kv,
                keep_kv=True)
            for i, (key, _) in enumerate(rows):
                n = int(mask[i].sum())
                fed = input_ids[i][attention[i].bool()].tolist() + responses[i, :max(n - 1, 0)].tolist()
                self.prefix.put(key, fed, *self.rollout.kept_kv[i])
        finally:
            self.rollout.kept_kv = None
        return responses, mask, log_probs

    def drop_prefix_cache(self) -> None:
        """Free the kept K/V now (the engine idle; the asynchronous trainers' pause, before training)."""
        if self.prefix is not None:
            self.prefix.clear()

    # ------------------------------------------------------------------ rollout TP > 1
    def close(self) -> None:
        """Rank 0 of a TP group: release the followers (no-op at TP 1). The kept K/V goes."""
        self.drop_prefix_cache()
        if self.rollout.tp_size > 1:
            dist.broadcast_object_list([None], group=self.rollout.tp_group, group_src=0)

    def release(self, marker: dict) -> None:
        """Rank 0 of a TP group, between engine calls: let the followers out of :meth:`follow` with ``marker``
        (what they are to do before following again: a standalone pool's command); no-op at TP 1. Every rank's
        kept K/V goes (the command may change the weights)."""
        self.drop_prefix_cache()
        if self.rollout.tp_size > 1:
            dist.broadcast_object_list([marker], group=self.rollout.tp_group, group_src=0)

    def follow(self) -> dict | None:
        """The other ranks of a TP group: run every call rank 0 makes until it closes (returns None) or releases
        them (returns the marker of :meth:`release`)."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, group=self.rollout.tp_group, group_src=0)
            if not isinstance(box[0], tuple):
                self.drop_prefix_cache()
                return box[0]
            input_ids, attention, params, limits, interruptible, plan = box[0]
            # an interruptible call: rank 0's decision to stop reaches every rank through the rule's all-reduce
            stop = _interrupt_rule(len(limits), None) if interruptible else None
            self._generate(input_ids, attention, params, limits, stop, plan)


def _interrupt_rule(rows: int, abort: Any) -> SegmentStop:
    """A segment rule that never stops for finished groups (each row its own group, one more group needed than
    there are) and stops when ``abort()`` says so."""
    return SegmentStop(torch.arange(rows), rows + 1, None, abort)
