"""The native rollout engine: batched prefill + decode with a preallocated KV cache, in process.

Left-padded prompts share cache slots: slot ``s`` holds prompt column ``s`` for every row, and
decode step ``t`` writes slot ``P + t`` for all rows at once, so a step is a handful of batched
ops with no per-sequence Python. Padding slots are never attended to; position ids count real
tokens only (as HF does for left padding). Generation stops early once every row has stopped.

Under rollout TP every rank of the group runs the same loop on the same prompts; logits are
gathered to the full vocabulary and every rank samples with the same seed, so all ranks choose the
same tokens without a broadcast.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from verl.engine.rollout.base import (
    BaseRollout,
    RolloutInputError,
    SamplingParams,
    check_prompts,
    prompt_position_ids,
)
from verl.engine.rollout.native.flat_params import FlatParams
from verl.engine.rollout.native.kv_cache import KVCache
from verl.engine.rollout.native.model import RolloutTransformer
from verl.engine.rollout.native.prefix_cache import PrefixCache
from verl.engine.rollout.native.sampler import sample_tokens
from verl.engine.rollout.native.weights import load_hf_checkpoint
from verl.engine.rollout.partial import SegmentStop
from verl.models.config import ModelConfig
from verl.models.rollout_shapes import kv_heads_per_rank, rollout_param_specs
from verl.utils.device import get_device


def empty_routing(rows: int, length: int, config: ModelConfig, device) -> torch.Tensor:
    """A routed_experts buffer [rows, length, MoE layers, top k] (int16) whose every token picks experts
    0..k-1: what a position no forward pass routed (padding; the last response token, which is sampled but
    never fed back) replays as, a valid distinct choice whose output no valid token reads."""
    k = config.num_experts_per_tok
    return torch.arange(k, dtype=torch.int16, device=device).expand(
        rows, length, len(config.moe_layers), k).contiguous()


class NativeRollout(BaseRollout):
    """One rollout TP rank. ``tp_group`` None means TP 1 (no process group needed).

    Weights start uninitialised: fill them with ``load_weights`` (named rollout-layout tensors),
    ``load_hf_checkpoint`` (an HF directory) or by writing ``weight_buffer()`` in place (the hybrid engine).
    """

    def __init__(self, config: ModelConfig, tp_group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype = torch.float32, pad_token_id: int = 0, device: torch.device | str | None = None):
        super().__init__(config, pad_token_id)
        # Weights, KV cache and sampling live on this rank's device; results return on the CPU.
        self.device = torch.device(device) if device is not None else get_device()
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.params = FlatParams(rollout_param_specs(config, self.tp_size, self.tp_rank), dtype, self.device)
        self.model = RolloutTransformer(config, self.params.views, self.tp_size, self.tp_rank, tp_group)
        self.kv_cache = KVCache(config.num_hidden_layers, kv_heads_per_rank(config, self.tp_size), config.head_dim,
                                dtype, self.device)
        # verl's rollout.enable_rollout_routing_replay: the last call's routed_experts (see generate_responses).
        self.record_routing = False
        self.routed_experts: torch.Tensor | None = None
        # Prefix reuse (generate_responses' prefix_kv / keep_kv): the last call's prefilled tokens and kept K/V.
        self.prefilled_tokens = 0
        self.kept_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # verl's rollout.enable_prefix_caching: the agent token server keeps each trajectory's K/V across turns,
        # at most this many tokens (None: the server sizes it, see TokenServer)
        self.prefix_caching = True
        self.prefix_cache_tokens: int | None = None

    # ---------------------------------------------------------------- weights and memory
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.params.load(named_tensors)

    def load_hf_checkpoint(self, model_dir: str) -> None:
        """Read this rank's slices of an HF safetensors checkpoint straight into the weight buffer."""
        if self.params.released:
            raise RuntimeError("native rollout: expected resumed memory, found it released; call resume() first")
        load_hf_checkpoint(model_dir, self.config, self.tp_size, self.tp_rank, self.params.views)

    def weight_buffer(self) -> torch.Tensor:
        return self.params.flat

    def swap_weight_buffer(self, flat: torch.Tensor) -> torch.Tensor:
        """Generate with ``flat`` from now on (a staging buffer a standalone pool filled while this engine
        generated with the old weights); returns the old buffer."""
        return self.params.swap(flat)

    def release(self) -> None:
        self.params.release()
        self.kv_cache.release()

    def resume(self) -> None:
        self.params.resume()

    # ---------------------------------------------------------------- generation
    def token_server(self, base: SamplingParams, pad_token_id: int | None = None) -> TokenServer:
        """verl's token-in/token-out server over this engine for agent loops (see :class:`TokenServer`)."""
        return TokenServer(self, base, self.pad_token_id if pad_token_id is None else pad_token_id)

    def _generator(self, seed: int | None) -> torch.Generator:
        if seed is None:
            drawn = torch.tensor([random.SystemRandom().randrange(2 ** 62)], dtype=torch.int64, device=self.device)
            if self.tp_size > 1:  # every rank must sample with the same stream
                dist.broadcast(drawn, group=self.tp_group, group_src=0)
            seed = int(drawn)
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def generate_responses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           sampling_params: SamplingParams, pad_token_id: int, limits: torch.Tensor | None = None,
                           stop: SegmentStop | None = None, prefix_kv: list | None = None,
                           keep_kv: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``limits`` [B*n]: each row's own token budget (<= response_length; a resumed partial rollout has
        used part of it); ``stop``: end the call early, before every row finished (partial rollout).
        With ``record_routing`` (an MoE model) ``routed_experts`` [B*n, P+R, MoE layers, top k] then holds
        the experts every prompt and response token was routed to, aligned with prompt + response columns
        (verl's ``routed_experts``).

        Prefix reuse (n=1; the agent token server's turns): ``prefix_kv[i]`` None or the K/V [layers, kv_heads,
        c, head_dim] of row i's first c prompt tokens (c < its prompt length), kept from an earlier call; the
        prefill then starts at the first column some row has no K/V for, and only the columns from there on are
        computed (``prefilled_tokens`` counts them, over all rows). ``keep_kv``: ``kept_kv[i]`` then holds row
        i's K/V of every token this call fed (its prompt and its sampled tokens but the last)."""
        if self.params.released:
            raise RuntimeError("native rollout: expected weights in memory, found them released; call resume() "
                               "and write the weights first")
        sp = sampling_params
        device = self.device
        input_ids = input_ids.to(device=device, dtype=torch.int64).repeat_interleave(sp.n, 0)
        prompt_valid = attention_mask.to(device).bool().repeat_interleave(sp.n, 0)
        batch, prompt_len = input_ids.shape
        steps = sp.response_length
        keys, values = self.kv_cache.reserve(batch, prompt_len + steps)
        positions = prompt_position_ids(prompt_valid)
        self.model.prepare(int(positions[:, -1].max()) + steps + 1)
        record = self.record_routing and self.config.is_moe
        self.model.record_routing = record
        routed = None

        key_valid = torch.zeros(batch, prompt_len + steps, dtype=torch.bool, device=device)
        key_valid[:, :prompt_len] = prompt_valid
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril_()
        # Padding queries see only themselves, so their softmax rows stay finite (and unused).
        allowed = (causal & prompt_valid[:, None, None, :]) | torch.eye(prompt_len, dtype=torch.bool, device=device)
        pads = prompt_len - prompt_valid.sum(-1)
        start = 0
        if prefix_kv is not None and not record:
            start = self._place_prefix(prefix_kv, pads.tolist(), sp.n, prompt_len, keys, values)
        self.prefilled_tokens = batch * (prompt_len - start)
        logits = self.model.forward(input_ids[:, start:], positions[:, start:], keys, values, start,
                                    allowed[:, :, start:])
        if record:
            routed = empty_routing(batch, prompt_len + steps, self.config, device)
            routed[:, :prompt_len] = self.model.routing

        generator = None if sp.greedy else self._generator(sp.seed)
        stop_ids = torch.tensor(sp.stop_ids, dtype=torch.int64, device=device)
        responses = torch.full((batch, steps), pad_token_id, dtype=torch.int64, device=device)
        log_probs = torch.zeros(batch, steps, dtype=torch.float32, device=device)
        lengths = torch.zeros(batch, dtype=torch.int64, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        next_positions = positions[:, -1:] + 1
        if limits is not None:
            limits = limits.to(device)
            done |= limits <= 0
        for t in range(steps):
            tokens, token_log_probs = sample_tokens(logits, sp, generator)
            responses[:, t] = tokens.masked_fill(done, pad_token_id)
            log_probs[:, t] = token_log_probs.masked_fill(done, 0.0)
            lengths += ~done
            if len(sp.stop_ids):
                done |= torch.isin(tokens, stop_ids)
            if limits is not None:
                done |= lengths >= limits
            if bool(done.all()) or (stop is not None and stop.reached(done, self.tp_group)):
                break
            if t + 1 == steps:
                break
            slot = prompt_len + t
            key_valid[:, slot] = True
            logits = self.model.forward(tokens[:, None], next_positions, keys, values, slot,
                                        key_valid[:, None, None, :slot + 1])
            if record:
                routed[:, slot] = self.model.routing[:, 0]
            next_positions += 1
        response_mask = torch.arange(steps, device=device)[None, :] < lengths[:, None]
        self.model.record_routing = False
        self.routed_experts = None if routed is None else routed.cpu()
        if keep_kv:  # a row's fed tokens sit in contiguous slots: its prompt, then its sampled tokens but the last
            ends = (prompt_len + lengths - 1).clamp(min=prompt_len).tolist()
            self.kept_kv = [(keys[:, i, :, pad:end].clone(), values[:, i, :, pad:end].clone())
                            for i, (pad, end) in enumerate(zip(pads.tolist(), ends, strict=True))]
        return responses.cpu(), response_mask.cpu(), log_probs.cpu()

    def _place_prefix(self, prefix_kv: list, pads: list[int], n: int, prompt_len: int, keys: torch.Tensor,
                      values: torch.Tensor) -> int:
        """Write the kept K/V of each row's prompt prefix into the call's cache; returns the first column the
        prefill must compute (every column before it holds K/V: kept, or zeros under the padding)."""
        if n != 1 or len(prefix_kv) != len(pads):
            raise RuntimeError(f"prefix reuse: expected n=1 and one entry per row ({len(pads)}), found n={n} and "
                               f"{len(prefix_kv)}")
        start = min((pad + (0 if kv is None else kv[0].shape[2]) for pad, kv in zip(pads, prefix_kv, strict=True)),
                    default=0)
        start = min(start, prompt_len - 1)  # every row computes at least its last prompt column (its logits)
        if start == 0:
            return 0
        keys[:, :, :, :start].zero_()  # padding columns nobody computes: finite, and masked out
        values[:, :, :, :start].zero_()
        for i, (pad, kv) in enumerate(zip(pads, prefix_kv, strict=True)):
            if kv is not None and start > pad:
                keys[:, i, :, pad:start] = kv[0][:, :, :start - pad]
                values[:, i, :, pad:start] = kv[1][:, :, :start - pad]
        return start


# ---------------------------------------------------------------------------- token-in/token-out for agent loops
_REQUEST_KEYS = ("temperature", "top_p", "top_k", "do_sample", "ignore_eos", "seed")


async def wait_at_gate(server: Any, gate: asyncio.Event) -> None:
    """A turn held while a weight sync runs (``gate`` cleared by ``interrupt``): counted in ``server.parked`` until
    ``resume_turns`` opens the gate again. Both token servers (native, SGLang) hold their turns here."""
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


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    limit: int
    params: SamplingParams
    future: asyncio.Future
    key: str  # the trajectory's request_id: its kept K/V


def prefix_budget(rollout: NativeRollout) -> int:
    """The prefix cache's budget in tokens: the engine's ``prefix_cache_tokens`` (the registry sets one full
    batch's KV: max rows x max sequence length), else what 1 GiB of the whole model's K/V holds."""
    if rollout.prefix_cache_tokens is not None:
        return int(rollout.prefix_cache_tokens)
    c = rollout.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * rollout.kv_cache.dtype.itemsize
    return max(1, 2**30 // per_token)


class TokenServer:
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

    def __init__(self, rollout: NativeRollout, base: SamplingParams, pad_token_id: int):
        self.rollout = rollout
        self.base = dataclasses.replace(base, n=1)
        self.pad_token_id = pad_token_id
        self.calls = 0          # engine calls made (batched turns)
        self.requests = 0       # turns served
        self._pending: list[_Request] = []
        self._driver: asyncio.Task | None = None
        self.interruptible = False
        self.interrupted = 0    # turn segments cut by interrupt()
        self.parked = 0         # turns waiting for resume_turns()
        self._abort = False     # read by the engine thread's stop rule
        self._gate: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The model version of the weights the engine holds (the asynchronous trainer's; None: untracked): each
        # turn reports the versions that sampled its tokens (``versions``), one per engine call that added some.
        self.version: int | None = None
        self.prefix = PrefixCache(prefix_budget(rollout)) if rollout.prefix_caching else None
        self._prefix_version: int | None = None
        self._drop_prefix = False  # an interrupt: the weights may change before the next call
        self.prompt_tokens = 0  # the turns' prompt tokens
        self.cached_tokens = 0  # of them, those whose K/V came from the prefix cache

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
            params = dataclasses.replace(params, seed=params.seed + 7919 * self.calls)
        params = dataclasses.replace(params, response_length=steps)
        # Each row fits the context by its own budget; the batch's longest prompt + longest budget may not.
        check_prompts(input_ids, attention, self.rollout.config.vocab_size, width + steps, steps)
        self.calls += 1
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
