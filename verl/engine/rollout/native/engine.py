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

import random
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from verl.engine.rollout.base import (
    BaseRollout,
    SamplingParams,
    prompt_position_ids,
)
from verl.engine.rollout.native.flat_params import FlatParams
from verl.engine.rollout.native.kv_cache import KVCache
from verl.engine.rollout.native.model import RolloutTransformer
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

    swaps_weight_buffer = True

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

    def resident_tensors(self) -> list[torch.Tensor]:
        return [self.params.flat, *(t for t in (self.kv_cache.keys, self.kv_cache.values) if t is not None)]

    def release(self) -> None:
        self.params.release()
        self.kv_cache.release()

    def resume(self) -> None:
        self.params.resume()

    # ---------------------------------------------------------------- generation
    def token_server(self, base: SamplingParams, pad_token_id: int | None = None) -> Any:
        """verl's token-in/token-out server over this engine for agent loops
        (:class:`~verl.engine.rollout.native.token_server.TokenServer`)."""
        from verl.engine.rollout.native.token_server import TokenServer

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
        if sp.n > 1 and start == 0:
            logits = self._prefill_once_per_prompt(input_ids, positions, allowed, keys, values, sp.n)
        else:
            self.prefilled_tokens = batch * (prompt_len - start)
            logits = self.model.forward(input_ids[:, start:], positions[:, start:], keys, values, start,
                                        allowed[:, :, start:])
        if record:
            routed = empty_routing(batch, prompt_len + steps, self.config, device)
            routed[:, :prompt_len] = self.model.routing.repeat_interleave(batch // self.model.routing.shape[0], 0)

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

    def _prefill_once_per_prompt(self, input_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                                 keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
        """Prefill each prompt once for its ``n`` samples (rows i*n .. i*n+n-1 hold the same prompt): the prompt's
        K/V is computed on one row and copied to the others, and its last logits are theirs, as SGLang and vLLM
        share a prompt's prefix across the samples of ``n``. Returns the logits [B*n, vocab]."""
        prompt_len = input_ids.shape[1]
        once = slice(None, None, n)
        shape = (keys.shape[0], input_ids.shape[0] // n, keys.shape[2], prompt_len, keys.shape[4])
        prompt_keys = torch.empty(shape, dtype=keys.dtype, device=keys.device)
        prompt_values = torch.empty(shape, dtype=values.dtype, device=values.device)
        logits = self.model.forward(input_ids[once], positions[once], prompt_keys, prompt_values, 0, allowed[once])
        keys[:, :, :, :prompt_len] = prompt_keys.repeat_interleave(n, 1)
        values[:, :, :, :prompt_len] = prompt_values.repeat_interleave(n, 1)
        self.prefilled_tokens = shape[1] * prompt_len
        return logits.repeat_interleave(n, 0)

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
