"""The pure-torch reference of the 3D-HybridEngine reshard (the test oracle).

Plain narrow/cat/view code, written independently of the model spec and the planner's layout tables:
``random_hf_weights`` (a seeded full HF weight set of a Qwen2/Llama/Qwen3(-MoE) config), ``megatron_shard`` (a
Megatron GPTModel rank's state dict), ``fsdp_shard`` (FSDP2's local shards) and ``sglang_shard`` (an
SGLang rollout rank's parameters), each built from the full HF weights. The reshard tests compare what
the planner and executor produce against these.
"""

from __future__ import annotations

import torch

from verl.models.config import ModelConfig


def random_hf_weights(config: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A full HF-style (unfused) weight set, identical on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    w = {"model.embed_tokens.weight": rand(config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = rand(h)
        w[p + "self_attn.q_proj.weight"] = rand(q, h)
        w[p + "self_attn.k_proj.weight"] = rand(kv, h)
        w[p + "self_attn.v_proj.weight"] = rand(kv, h)
        if config.attention_bias:
            w[p + "self_attn.q_proj.bias"] = rand(q)
            w[p + "self_attn.k_proj.bias"] = rand(kv)
            w[p + "self_attn.v_proj.bias"] = rand(kv)
        w[p + "self_attn.o_proj.weight"] = rand(h, q)
        if config.qk_norm:
            w[p + "self_attn.q_norm.weight"] = rand(hd)
            w[p + "self_attn.k_norm.weight"] = rand(hd)
        w[p + "post_attention_layernorm.weight"] = rand(h)
        if i in config.moe_layers:
            w[p + "mlp.gate.weight"] = rand(config.num_experts, h)
            for e in range(config.num_experts):
                w[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(config.moe_intermediate_size, h)
                w[p + f"mlp.experts.{e}.up_proj.weight"] = rand(config.moe_intermediate_size, h)
                w[p + f"mlp.experts.{e}.down_proj.weight"] = rand(h, config.moe_intermediate_size)
            continue
        w[p + "mlp.gate_proj.weight"] = rand(inter, h)
        w[p + "mlp.up_proj.weight"] = rand(inter, h)
        w[p + "mlp.down_proj.weight"] = rand(h, inter)
    w["model.norm.weight"] = rand(h)
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = rand(config.vocab_size, h)
    return w


def _pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])])


def megatron_shard(hf: dict[str, torch.Tensor], config: ModelConfig, tp: int, pp: int, tp_rank: int,
                   pp_rank: int, ep: int = 1, ep_rank: int = 0, etp: int | None = None,
                   etp_rank: int | None = None) -> dict[str, torch.Tensor]:
    """Megatron GPTModel (local spec) state dict of (pp_rank, tp_rank), built from full HF weights; an MoE
    layer holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep) as local_experts.0.., each cut over etp (None: tp)."""
    etp, etp_rank = (tp, tp_rank) if etp is None else (etp, etp_rank)
    ng, hd = config.num_key_value_heads, config.head_dim
    vm = -(-config.vocab_size // (128 * tp)) * 128 * tp
    per_stage = config.num_hidden_layers // pp
    out: dict[str, torch.Tensor] = {}

    def vocab_shard(table):
        return _pad_rows(table, vm).chunk(tp)[tp_rank].clone()

    def qkv(layer, suffix):
        q = layer[f"self_attn.q_proj.{suffix}"]
        rest = q.shape[1:]
        grouped = torch.cat([q.reshape(ng, -1, *rest), layer[f"self_attn.k_proj.{suffix}"].reshape(ng, hd, *rest),
                             layer[f"self_attn.v_proj.{suffix}"].reshape(ng, hd, *rest)], dim=1)
        return grouped.chunk(tp)[tp_rank].reshape(-1, *rest).clone()

    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = vocab_shard(hf["model.embed_tokens.weight"])
    for k in range(per_stage):
        i = pp_rank * per_stage + k
        layer = {n[len(f"model.layers.{i}."):]: t for n, t in hf.items() if n.startswith(f"model.layers.{i}.")}
        m = f"decoder.layers.{k}."
        out[m + "input_layernorm.weight"] = layer["input_layernorm.weight"].clone()
        proj = layer["self_attn.o_proj.weight"].chunk(tp, dim=1)[tp_rank]
        out[m + "self_attention.linear_proj.weight"] = proj.clone()
        out[m + "self_attention.linear_qkv.weight"] = qkv(layer, "weight")
        if config.attention_bias:
            out[m + "self_attention.linear_qkv.bias"] = qkv(layer, "bias")
        if config.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = layer["self_attn.q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = layer["self_attn.k_norm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = layer["post_attention_layernorm.weight"].clone()
        if i in config.moe_layers:
            out[m + "mlp.router.weight"] = layer["mlp.gate.weight"].clone()
            per_rank = config.num_experts // ep
            for j in range(per_rank):
                x = f"mlp.experts.{ep_rank * per_rank + j}."
                local = m + f"mlp.experts.local_experts.{j}."
                out[local + "linear_fc1.weight"] = torch.cat([layer[x + "gate_proj.weight"].chunk(etp)[etp_rank],
                                                              layer[x + "up_proj.weight"].chunk(etp)[etp_rank]])
                out[local + "linear_fc2.weight"] = layer[x + "down_proj.weight"].chunk(etp, dim=1)[etp_rank].clone()
            continue
        out[m + "mlp.linear_fc1.weight"] = torch.cat([layer["mlp.gate_proj.weight"].chunk(tp)[tp_rank],
                                                      layer["mlp.up_proj.weight"].chunk(tp)[tp_rank]])
        out[m + "mlp.linear_fc2.weight"] = layer["mlp.down_proj.weight"].chunk(tp, dim=1)[tp_rank].clone()
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not config.tie_word_embeddings:
            out["output_layer.weight"] = vocab_shard(hf["lm_head.weight"])
        elif pp > 1:
            out["output_layer.weight"] = vocab_shard(hf["model.embed_tokens.weight"])
    return out


def fsdp_shard(hf: dict[str, torch.Tensor], shard: int, shard_rank: int) -> dict[str, torch.Tensor]:
    """FSDP2's local shard of every HF tensor: torch.chunk on dim 0; ranks past the last chunk hold nothing."""
    out = {}
    for name, t in hf.items():
        chunks = torch.chunk(t, shard)
        out[name] = (chunks[shard_rank] if shard_rank < len(chunks) else t[:0]).clone()
    return out


def sglang_shard(hf: dict[str, torch.Tensor], config: ModelConfig, tp: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """SGLang per-rank parameters of rollout rank ``tp_rank`` of ``tp``, built from full HF weights."""
    ng, hd = config.num_key_value_heads, config.head_dim
    vp = -(-config.vocab_size // 64) * 64

    def kv_shard(t):
        if tp <= ng:
            return t.chunk(tp)[tp_rank]
        return t.reshape(ng, hd, *t.shape[1:])[tp_rank // (tp // ng)]

    out = {"model.embed_tokens.weight": _pad_rows(hf["model.embed_tokens.weight"], vp).chunk(tp)[tp_rank].clone()}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        for suffix in ("weight", "bias") if config.attention_bias else ("weight",):
            out[p + f"self_attn.qkv_proj.{suffix}"] = torch.cat([
                hf[p + f"self_attn.q_proj.{suffix}"].chunk(tp)[tp_rank],
                kv_shard(hf[p + f"self_attn.k_proj.{suffix}"]),
                kv_shard(hf[p + f"self_attn.v_proj.{suffix}"]),
            ])
        out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[tp_rank].clone()
        if config.qk_norm:
            out[p + "self_attn.q_norm.weight"] = hf[p + "self_attn.q_norm.weight"].clone()
            out[p + "self_attn.k_norm.weight"] = hf[p + "self_attn.k_norm.weight"].clone()
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        if i in config.moe_layers:
            # SGLang's fused MoE (ep_size 1): w13 [E, 2I/tp, H] = [gate; up] slices, w2 [E, H, I/tp].
            experts = range(config.num_experts)
            out[p + "mlp.gate.weight"] = hf[p + "mlp.gate.weight"].clone()
            out[p + "mlp.experts.w13_weight"] = torch.stack([torch.cat([
                hf[p + f"mlp.experts.{e}.gate_proj.weight"].chunk(tp)[tp_rank],
                hf[p + f"mlp.experts.{e}.up_proj.weight"].chunk(tp)[tp_rank]]) for e in experts]).flatten(0, 1)
            out[p + "mlp.experts.w2_weight"] = torch.stack([
                hf[p + f"mlp.experts.{e}.down_proj.weight"].chunk(tp, dim=1)[tp_rank] for e in experts]).flatten(0, 1)
            continue
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"].chunk(tp)[tp_rank],
                                                        hf[p + "mlp.up_proj.weight"].chunk(tp)[tp_rank]])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[tp_rank].clone()
    out["model.norm.weight"] = hf["model.norm.weight"].clone()
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = _pad_rows(hf["lm_head.weight"], vp).chunk(tp)[tp_rank].clone()
    return out
