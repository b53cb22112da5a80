"""Qwen2/Llama decoder forward over one rank's rollout-layout weights, with rollout tensor parallelism.

Weights are looked up by the model spec's roles (``verl.models.spec``), under its rollout names.
Per rank (G = rollout TP size): the fused QKV and gate/up weights are column-parallel (this rank's
heads / FFN slice, no communication); the attention and MLP output weights are row-parallel
(partial sums, all-reduced over the TP group); the embedding is vocab-parallel (rows outside this rank's vocab
slice contribute zeros, then all-reduce) and so are the logits (all-gathered to the full vocab for
sampling). Numerics follow HF: RMSNorm in float32, RoPE tables computed in float32 and cast.

Shapes: ``B`` batch, ``S`` new tokens this call, ``L`` cache slots in use, ``D`` head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl.hybrid_engine.rollout_layout import kv_heads_per_rank, padded_vocab_size
from verl.models.config import ModelConfig
from verl.models.spec.registry import model_spec

# One decoder layer's weights, in the order forward() unpacks them (qkv_bias may be absent).
LAYER_ROLES = ("attn_norm", "qkv", "qkv_bias", "attn_out", "mlp_norm", "gate_up", "mlp_out")


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
        self.vocab_rows = padded_vocab_size(config.vocab_size) // tp_size
        self.vocab_start = tp_rank * self.vocab_rows
        self.scale = self.head_dim ** -0.5

        spec = model_spec(config.model_type)
        self.embed = weights[spec.rollout_name("embedding")]
        self.output = self.embed if config.tie_word_embeddings else weights[spec.rollout_name("output")]
        self.final_norm = weights[spec.rollout_name("final_norm")]
        self.layers: list[tuple] = []
        for i in range(config.num_hidden_layers):
            names = [spec.rollout_name(role, i) for role in LAYER_ROLES]
            self.layers.append(tuple(weights.get(n) if role == "qkv_bias" else weights[n]
                                     for role, n in zip(LAYER_ROLES, names, strict=True)))
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)  # see prepare()

    def prepare(self, max_positions: int) -> None:
        """Make the RoPE tables cover positions [0, max_positions) (grown per request, not per step)."""
        if self.cos.shape[0] >= max_positions:
            return
        d = self.head_dim
        arange = torch.arange(0, d, 2, dtype=torch.float32, device=self.device)
        inv_freq = 1.0 / (self.config.rope_theta ** (arange / d))
        angles = torch.arange(max_positions, dtype=torch.float32, device=self.device)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(self.dtype)
        self.sin = angles.sin().to(self.dtype)

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

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> float32 logits [B, vocab_size] over the whole (unpadded) vocabulary."""
        local = F.linear(hidden, self.output)
        if self.tp_size > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp_size)]
            dist.all_gather(parts, local, group=self.tp_group)
            local = torch.cat(parts, dim=-1)
        return local[:, :self.config.vocab_size].float()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        # HF order for low precision: normalise in float32, cast back, then scale.
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps).to(x.dtype)

    # ---------------------------------------------------------------- attention
    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, S, D], keys/values [B, Hkv, L, D], allowed bool [B, 1, S, L] -> [B, Hq, S, D]."""
        B, Hq, S, D = q.shape
        if S > 1:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=Hq != self.kv_heads)
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
        hidden = self._embed(input_ids)
        cos = self.cos[positions].unsqueeze(2)  # [B, S, 1, D]
        sin = self.sin[positions].unsqueeze(2)
        half = self.head_dim // 2
        qk_heads = self.q_heads + self.kv_heads
        for layer, (ln1, w_qkv, b_qkv, w_o, ln2, w_gate_up, w_down) in enumerate(self.layers):
            qkv = F.linear(self._rms_norm(hidden, ln1), w_qkv, b_qkv)
            qk = qkv[..., :self.q_rows + self.kv_rows].reshape(B, S, qk_heads, self.head_dim)
            rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
            qk = qk * cos + rotated * sin
            q = qk[:, :, :self.q_heads].transpose(1, 2)
            keys[layer, :, :, start:end] = qk[:, :, self.q_heads:].transpose(1, 2)
            values[layer, :, :, start:end] = qkv[..., self.q_rows + self.kv_rows:].reshape(
                B, S, self.kv_heads, self.head_dim).transpose(1, 2)
            attn = self._attention(q, keys[layer, :, :, :end], values[layer, :, :, :end], allowed)
            hidden = hidden + self._all_reduce(F.linear(attn.transpose(1, 2).reshape(B, S, self.q_rows), w_o))
            gate_up = F.linear(self._rms_norm(hidden, ln2), w_gate_up)
            mlp = F.silu(gate_up[..., :self.ffn]) * gate_up[..., self.ffn:]
            hidden = hidden + self._all_reduce(F.linear(mlp, w_down))
        return self._logits(self._rms_norm(hidden[:, -1], self.final_norm))
