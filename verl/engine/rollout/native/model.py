"""The decoder forward of every spec family over one rank's rollout-layout
weights, with rollout tensor parallelism.

The block is read from the config's fields and the spec's roles, never from the model type: the MLP's activation
(``hidden_act``), the RMSNorm's parametrization (``norm_weight_offset``, ``norm_scale_in_float32``), the embedding's
multiplier, the attention's scale, each layer's window (``layer_window``: sliding-window attention
over cache slots, which are the row's positions shifted by its left padding) and RoPE base (``layer_rope_theta``),
q/k norms and norms after the attention and the MLP when the layer has those roles, and the final logits'
soft-capping.

Weights are looked up by the model spec's roles (``verl.models.spec``), under its rollout names.
Per rank (G = rollout TP size): the fused QKV and gate/up weights are column-parallel (this rank's
heads / FFN slice, no communication); the attention and MLP output weights are row-parallel
(partial sums, all-reduced over the TP group); the embedding is vocab-parallel (rows outside this rank's vocab
slice contribute zeros, then all-reduce) and so are the logits (all-gathered to the full vocab for
sampling). Numerics follow HF: RMSNorm in float32, RoPE tables computed in float32 and cast.

Mixture-of-experts layers (SGLang's fused-MoE layout, ``ep_size=1``): every rank holds every expert
with its ``moe_intermediate_size / G`` slice (``w13`` [E, 2I/G, H] = [gate; up] rows, ``w2`` [E, H, I/G]);
the router is replicated, so every rank picks the same experts; each rank runs its slice of the chosen
experts and one all-reduce sums the slices, as for the dense MLP.

Shapes: ``B`` batch, ``S`` new tokens this call, ``L`` cache slots in use, ``D`` head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl.models.config import ModelConfig
from verl.models.rollout_shapes import kv_heads_per_rank, padded_vocab_size
from verl.models.rope import inv_freq as rope_inv_freq
from verl.models.spec.registry import model_spec
from verl.ops.cpu_gemm import pick_linear


class RolloutTransformer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tp_size: int = 1, tp_rank: int = 0,
                 tp_group: dist.ProcessGroup | None = None):
        self.config = config
        self.tp_size, self.tp_rank, self.tp_group = tp_size, tp_rank, tp_group
        self.q_heads = config.num_attention_heads // tp_size
        self.kv_heads = kv_heads_per_rank(config, tp_size)
        self.head_dim = config.head_dim
        self.q_rows = self.q_heads * self.head_dim
        self.kv_rows = self.kv_heads * self.head_dim
        self.ffn = config.intermediate_size // tp_size
        self.expert_ffn = config.moe_intermediate_size // tp_size
        self.vocab_rows = padded_vocab_size(config.vocab_size) // tp_size
        self.vocab_start = tp_rank * self.vocab_rows
        self.scale = config.attention_scale
        self.act = F.silu if config.hidden_act == "silu" else (lambda x: F.gelu(x, approximate="tanh"))
        # Each layer's RoPE (base, scaling) as an index into the tables prepare() builds, one per distinct kind.
        kinds = [config.layer_rope_theta(i) for i in range(config.num_hidden_layers)]
        self.rope_kinds = list(dict.fromkeys(kinds))
        self.layer_rope = [self.rope_kinds.index(k) for k in kinds]
        self.windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]

        spec = model_spec(config.model_type)
        self.embed = weights[spec.rollout_name("embedding")]
        self.output = self.embed if config.tie_word_embeddings else weights[spec.rollout_name("output")]
        self.final_norm = weights[spec.rollout_name("final_norm")]
        # Per layer: role -> weight (roles a layer lacks, e.g. qkv_bias or q_norm, are absent).
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(config.num_hidden_layers):
            # The weight buffer's own views: a standalone pool swaps the buffer under them (FlatParams.swap
            # rebinds these very tensors), so no derived view is kept.
            self.layers.append({role: weights[name] for role, name in spec.rollout_layer(config, i).items()})
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.linear = pick_linear(self.dtype, self.device)
        # Routing replay: when True, forward() leaves each new token's chosen experts in ``routing``
        # ([B, S, MoE layers, top k] int16, HF's expert ids).
        self.record_routing = False
        self.routing: torch.Tensor | None = None
        empty = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)  # see prepare()
        self.cos, self.sin = [empty] * len(self.rope_kinds), [empty] * len(self.rope_kinds)

    def prepare(self, max_positions: int) -> None:
        """Make the RoPE tables cover positions [0, max_positions) (grown per request, not per step)."""
        if self.cos[0].shape[0] >= max_positions:
            return
        for k, (theta, rope) in enumerate(self.rope_kinds):
            # Plain or scaled RoPE from the one shared function; YaRN also scales cos and sin (HF's attention_scaling).
            inv_freq, scale = rope_inv_freq(self.head_dim, theta, rope, device=self.device)
            angles = torch.arange(max_positions, dtype=torch.float32, device=self.device)[:, None] * inv_freq[None, :]
            angles = torch.cat([angles, angles], dim=-1)
            self.cos[k] = (angles.cos() * scale).to(self.dtype)
            self.sin[k] = (angles.sin() * scale).to(self.dtype)

    # ---------------------------------------------------------------- tensor-parallel pieces
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self._all_reduce(hidden)

    def _scaled_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self._embed(input_ids)
        if self.config.embedding_multiplier != 1.0:  # HF: the multiplier cast to the weights' dtype, then the product
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=self.dtype, device=self.device)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> float32 logits [B, vocab_size] over the whole (unpadded) vocabulary."""
        local = self.linear(hidden, self.output)
        if self.tp_size > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp_size)]
            dist.all_gather(parts, local, group=self.tp_group)
            local = torch.cat(parts, dim=-1)
        logits = local[:, :self.config.vocab_size].float()
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.norm_scale_in_float32:  # (offset + w) applied in float32, then cast
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=c.rms_norm_eps)
            return (normed * (weight.float() + c.norm_weight_offset)).to(x.dtype)
        if c.norm_weight_offset:
            weight = weight + c.norm_weight_offset
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        # HF order for low precision: normalise in float32, cast back, then scale.
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps).to(x.dtype)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Qwen3's per-head RMSNorm over the last (head_dim) axis; identity when the model has none."""
        return x if weight is None else self._rms_norm(x, weight)

    # ---------------------------------------------------------------- mixture of experts
    def _moe(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [N, H] -> this rank's partial sum [N, H] of the chosen experts' outputs, weighted as HF's
        router weights them (softmax over all experts in float32, top k, renormalised if norm_topk_prob)."""
        c = self.config
        probs = self.linear(x, layer["router"]).float().softmax(dim=-1)
        weights, chosen = probs.topk(c.num_experts_per_tok, dim=-1)
        if self.record_routing:
            self._choices.append(chosen.to(torch.int16))
        if c.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # SGLang's [E, rows, cols] view of the stacked experts, taken per call (see __init__).
        w13 = layer["expert_fc1"].view(c.num_experts, -1, layer["expert_fc1"].shape[-1])
        w2 = layer["expert_fc2"].view(c.num_experts, -1, layer["expert_fc2"].shape[-1])
        for expert in chosen.unique().tolist():
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            gate_up = self.linear(x[token], w13[expert])
            h = self.act(gate_up[:, :self.expert_ffn]) * gate_up[:, self.expert_ffn:]
            out.index_add_(0, token, self.linear(h, w2[expert]) * weights[token, slot, None])
        return out

    # ---------------------------------------------------------------- attention
    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, S, D], keys/values [B, Hkv, L, D], allowed bool [B, 1, S, L] -> [B, Hq, S, D]."""
        B, Hq, S, D = q.shape
        if S > 1:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=self.scale,
                                                  enable_gqa=Hq != self.kv_heads)
        # Decode: the query heads sharing a KV head become rows of one matmul (no K/V expansion).
        grouped = q.reshape(B, self.kv_heads, Hq // self.kv_heads, D)
        scores = torch.matmul(grouped * self.scale, keys.transpose(-1, -2))
        scores = scores.float().masked_fill_(~allowed, float("-inf")).softmax(-1).to(q.dtype)
        return torch.matmul(scores, values).reshape(B, Hq, 1, D)

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                start: int, allowed: torch.Tensor) -> torch.Tensor:
        """Run ``S`` new tokens per row, writing their K/V at cache slots [start, start+S).

        input_ids/positions [B, S]; keys/values [layers, B, Hkv, max_len, D] (the request's cache
        views); allowed bool [B, 1, S, start+S]: which cache slots each new token may attend to.
        Returns float32 logits [B, vocab_size] of the last new token of every row.
        """
        B, S = input_ids.shape
        end = start + S
        self._choices: list[torch.Tensor] = []
        hidden = self._scaled_embed(input_ids)
        cos = [t[positions].unsqueeze(2) for t in self.cos]  # per RoPE kind [B, S, 1, D]
        sin = [t[positions].unsqueeze(2) for t in self.sin]
        half = self.head_dim // 2
        qk_heads = self.q_heads + self.kv_heads
        # Sliding layers: a query at slot start+s sees the keys at slots > start+s-window (of those allowed).
        masks = {0: allowed}
        for window in set(self.windows) - {0}:
            slots = torch.arange(end, device=allowed.device)
            masks[window] = allowed & (slots[None, :] > (slots[start:end, None] - window))
        for index, layer in enumerate(self.layers):
            qkv = self.linear(self._rms_norm(hidden, layer["attn_norm"]), layer["qkv"], layer.get("qkv_bias"))
            qk = qkv[..., :self.q_rows + self.kv_rows].reshape(B, S, qk_heads, self.head_dim)
            if "q_norm" in layer:
                qk = torch.cat([self._head_norm(qk[:, :, :self.q_heads], layer["q_norm"]),
                                self._head_norm(qk[:, :, self.q_heads:], layer["k_norm"])], dim=2)
            rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
            kind = self.layer_rope[index]
            qk = qk * cos[kind] + rotated * sin[kind]
            q = qk[:, :, :self.q_heads].transpose(1, 2)
            keys[index, :, :, start:end] = qk[:, :, self.q_heads:].transpose(1, 2)
            values[index, :, :, start:end] = qkv[..., self.q_rows + self.kv_rows:].reshape(
                B, S, self.kv_heads, self.head_dim).transpose(1, 2)
            attn = self._attention(q, keys[index, :, :, :end], values[index, :, :, :end],
                                   masks[self.windows[index]])
            attn_out = self._all_reduce(self.linear(attn.transpose(1, 2).reshape(B, S, self.q_rows), layer["attn_out"]))
            if "attn_post_norm" in layer:  # a norm of the whole (all-reduced) output, before the residual add
                attn_out = self._rms_norm(attn_out, layer["attn_post_norm"])
            hidden = hidden + attn_out
            normed = self._rms_norm(hidden, layer["mlp_norm"])
            if "router" in layer:
                mlp_out = self._moe(normed.reshape(B * S, -1), layer).view(B, S, -1)
            else:
                gate_up = self.linear(normed, layer["gate_up"])
                mlp_out = self.linear(self.act(gate_up[..., :self.ffn]) * gate_up[..., self.ffn:], layer["mlp_out"])
            mlp_out = self._all_reduce(mlp_out)
            if "mlp_post_norm" in layer:
                mlp_out = self._rms_norm(mlp_out, layer["mlp_post_norm"])
            hidden = hidden + mlp_out
        if self.record_routing:
            self.routing = torch.stack(self._choices, dim=1).view(B, S, len(self._choices), -1)
        return self._logits(self._rms_norm(hidden[:, -1], self.final_norm))
