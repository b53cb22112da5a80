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

import torch
import torch.distributed as dist

from verl.engine.rollout.base import BaseRollout, SamplingParams, prompt_position_ids
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
                           stop: SegmentStop | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``limits`` [B*n]: each row's own token budget (<= response_length; a resumed partial rollout has
        used part of it); ``stop``: end the call early, before every row finished (partial rollout).
        With ``record_routing`` (an MoE model) ``routed_experts`` [B*n, P+R, MoE layers, top k] then holds
        the experts every prompt and response token was routed to, aligned with prompt + response columns
        (verl's ``routed_experts``)."""
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
        logits = self.model.forward(input_ids, positions, keys, values, 0, allowed)
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
        return responses.cpu(), response_mask.cpu(), log_probs.cpu()
