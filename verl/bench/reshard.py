"""`verl bench reshard`: the 3D-HybridEngine against the naive gather-everything path, verified.

    verl bench reshard --model CONFIG.json --train tp=T,pp=P,dp=D --rollout tp=G --nproc N --json PATH
    verl bench reshard --model CONFIG.json --train fsdp=S[,replicate=R] --rollout tp=G --nproc S*R

Spawns N local gloo ranks. Every rank builds the same seeded full HF weight set, takes its Megatron
training shard from it, reshards into the SGLang rollout layout with the planner + executor, and
checks the result bit-exactly against a pure-torch reference built from the full HF weights. The
same run times the naive path (per-tensor TP all-gather + PP broadcast -> HF rename/split -> per-rank
narrow/copy, what today's frameworks do) and a memcpy of the rollout shard's bytes.

With ``fsdp=``, the training side is a real FSDP2 model (a transformers CausalLM with those weights,
``fully_shard`` per decoder layer and at the root, HSDP with ``replicate``); the naive path is verl's
per-parameter ``full_tensor()`` then narrow/copy, and each rank's bytes received are compared with
its own bound (its rollout shard minus what its FSDP shard already holds of it).

The reference functions here (``random_hf_weights``, ``megatron_shard``, ``fsdp_shard``, ``sglang_shard``)
are plain narrow/cat/view code, written independently of the planner's layout tables: they are the oracle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence

import torch

from verl.hybrid_engine.planner import DEFAULT_BUCKET_BYTES
from verl.models.config import ModelConfig, ModelConfigError
from verl.utils.torch_dtypes import DTYPES

# ------------------------------------------------------------------------------------------------
# Pure-torch reference (oracle)
# ------------------------------------------------------------------------------------------------

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
        w[p + "post_attention_layernorm.weight"] = rand(h)
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
                   pp_rank: int) -> dict[str, torch.Tensor]:
    """Megatron GPTModel (local spec) state dict of (pp_rank, tp_rank), built from full HF weights."""
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
        out[m + "pre_mlp_layernorm.weight"] = layer["post_attention_layernorm.weight"].clone()
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
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"].chunk(tp)[tp_rank],
                                                        hf[p + "mlp.up_proj.weight"].chunk(tp)[tp_rank]])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[tp_rank].clone()
    out["model.norm.weight"] = hf["model.norm.weight"].clone()
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = _pad_rows(hf["lm_head.weight"], vp).chunk(tp)[tp_rank].clone()
    return out


# ------------------------------------------------------------------------------------------------
# Local gloo ranks
# ------------------------------------------------------------------------------------------------

def spawn_gloo_ranks(fn, nproc: int, args: tuple = (), timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` local gloo ranks, one thread each; the first rank
    failure, or the timeout, ends every rank and raises."""
    from verl.launcher.spawn import run_ranks_with_rank

    return run_ranks_with_rank(fn, nproc, *args, timeout_s=timeout_s, threads_per_rank=1)


# ------------------------------------------------------------------------------------------------
# The naive path (today's frameworks): gather every tensor to full size, rename, narrow
# ------------------------------------------------------------------------------------------------

def _naive_full_to_hf(name: str, full: torch.Tensor, config: ModelConfig, tp: int, pp_rank: int,
                      per_stage: int) -> dict[str, torch.Tensor]:
    """HF tensors from one all-gathered Megatron tensor (the rename/split table)."""
    v, ng, hd = config.vocab_size, config.num_key_value_heads, config.head_dim
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": full[:v]}
    if name == "output_layer.weight":
        return {} if config.tie_word_embeddings else {"lm_head.weight": full[:v]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    _, _, k, rest = name.split(".", 3)
    p = f"model.layers.{pp_rank * per_stage + int(k)}."
    if rest.startswith("self_attention.linear_qkv."):
        suffix = rest.rsplit(".", 1)[1]
        grouped = full.reshape(ng, -1, *full.shape[1:])
        q_rows = grouped.shape[1] - 2 * hd
        return {p + f"self_attn.q_proj.{suffix}": grouped[:, :q_rows].reshape(-1, *full.shape[1:]),
                p + f"self_attn.k_proj.{suffix}": grouped[:, q_rows:q_rows + hd].reshape(-1, *full.shape[1:]),
                p + f"self_attn.v_proj.{suffix}": grouped[:, q_rows + hd:].reshape(-1, *full.shape[1:])}
    if rest == "mlp.linear_fc1.weight":
        halves = full.reshape(tp, 2, -1, full.shape[1])
        return {p + "mlp.gate_proj.weight": halves[:, 0].reshape(-1, full.shape[1]),
                p + "mlp.up_proj.weight": halves[:, 1].reshape(-1, full.shape[1])}
    rename = {"input_layernorm.weight": "input_layernorm.weight",
              "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
              "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
              "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
    return {p + rename[rest]: full}


def sglang_shard_partial(hf: dict[str, torch.Tensor], config: ModelConfig, tp: int,
                         tp_rank: int) -> dict[str, torch.Tensor]:
    """The rollout-rank slices of whichever HF tensors are given, keyed 'rollout name:row offset'."""
    ng, hd = config.num_key_value_heads, config.head_dim
    vp = -(-config.vocab_size // 64) * 64
    q_rows = config.num_attention_heads // tp * hd
    kv_rows = max(1, ng // tp) * hd
    ffn = config.intermediate_size // tp
    out = {}
    for name, t in hf.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = vp // tp
            lo, hi = tp_rank * rows, min((tp_rank + 1) * rows, config.vocab_size)
            out[f"{name}:0"] = t[lo:hi] if hi > lo else t[:0]
            continue
        base, kind = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
        if kind in ("q_proj", "k_proj", "v_proj"):
            suffix = name.rsplit(".", 1)[1]
            target = f"{base}.qkv_proj.{suffix}"
            if kind == "q_proj":
                out[f"{target}:0"] = t.chunk(tp)[tp_rank]
            else:
                shard = t.chunk(tp)[tp_rank] if tp <= ng else t.reshape(ng, hd, *t.shape[1:])[tp_rank // (tp // ng)]
                out[f"{target}:{q_rows + (kv_rows if kind == 'v_proj' else 0)}"] = shard
        elif kind in ("gate_proj", "up_proj"):
            out[f"{base}.gate_up_proj.weight:{ffn if kind == 'up_proj' else 0}"] = t.chunk(tp)[tp_rank]
        elif kind in ("o_proj", "down_proj"):
            out[f"{name}:0"] = t.chunk(tp, dim=1)[tp_rank]
        else:
            out[f"{name}:0"] = t
    return out


def naive_reshard(rank: int, config: ModelConfig, training, rollout_tp: int, train: dict[str, torch.Tensor],
                  rollout_params: dict[str, torch.Tensor], tp_groups: dict, pp_groups: dict) -> None:
    """Per-tensor TP all-gather + PP broadcast to full size -> HF rename/split -> narrow/copy."""
    import torch.distributed as dist

    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.layouts import training_param_specs

    tp, pp = training.tp, training.pp
    my_stage, dp, r = training.coords(rank)
    j = derive_groups(training, rollout_tp).rollout_tp_rank[rank]
    per_stage = config.num_hidden_layers // pp
    for stage in range(pp):
        for name, shape in training_param_specs(config, tp, pp, r, stage):
            dim = None if name.endswith("layernorm.weight") else (
                1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0)
            if stage == my_stage:
                local = train[name]
                if dim is None or tp == 1:
                    full = local
                else:
                    parts = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(parts, local, group=tp_groups[(stage, dp)])
                    full = torch.cat(parts, dim=dim)
            else:
                full_shape = list(shape)
                if dim is not None:
                    full_shape[dim] *= tp
                full = torch.empty(full_shape, dtype=next(iter(train.values())).dtype)
            if pp > 1:
                dist.broadcast(full, src=training.rank(stage, dp, r), group=pp_groups[(dp, r)])
            for hf_name, t in _naive_full_to_hf(name, full, config, tp, stage, per_stage).items():
                for key, piece in sglang_shard_partial({hf_name: t}, config, rollout_tp, j).items():
                    target, row = key.rsplit(":", 1)
                    rollout_params[target][int(row):int(row) + piece.shape[0]].copy_(piece)


# ------------------------------------------------------------------------------------------------
# One benchmark rank
# ------------------------------------------------------------------------------------------------

def _timed(fn, repeats: int) -> float:
    """Best-of-``repeats`` wall time of a collective step, barrier to barrier."""
    import torch.distributed as dist

    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best


def _time_naive(reshard, executor, got: dict, reference: dict, dtype: torch.dtype, repeats: int) -> dict:
    """Best-of-``repeats`` time of a naive reshard ``reshard(params)`` into buffers of the rollout's layout, and
    whether it matches ``reference``: the baseline both the Megatron and the FSDP benchmark report."""
    naive_flat = torch.zeros(executor.rollout_numel, dtype=dtype)
    naive_params = {n: naive_flat[o:o + t.numel()].view(t.shape)
                    for (n, o), t in zip(executor.rollout_offsets.items(), got.values(), strict=False)}
    seconds = _timed(lambda: reshard(naive_params), repeats)
    return {"naive_seconds": seconds,
            "naive_verified": all(torch.equal(naive_params[n], t) for n, t in reference.items())}


def build_training_buffer(config: ModelConfig, training, rank: int, hf: dict[str, torch.Tensor], dtype: torch.dtype):
    """(flat buffer, offsets, views) of this rank's Megatron shard, in training_param_specs order."""
    from verl.hybrid_engine.executor import flat_offsets
    from verl.hybrid_engine.layouts import training_param_specs

    stage, _, r = training.coords(rank)
    shard = megatron_shard(hf, config, training.tp, training.pp, r, stage)
    specs = training_param_specs(config, training.tp, training.pp, r, stage)
    found = [(n, tuple(t.shape)) for n, t in shard.items()]
    if [(s.name, tuple(s.shape)) for s in specs] != found:
        raise RuntimeError(f"training layout: expected the reference Megatron shard {found}, found specs {specs}")
    offsets, numel = flat_offsets(specs)
    flat = torch.empty(numel, dtype=dtype)
    views = {}
    for name, shape in specs:
        views[name] = flat[offsets[name]:offsets[name] + shard[name].numel()].view(shape)
        views[name].copy_(shard[name])
    return flat, offsets, views


def reshard_rank(rank: int, nproc: int, cfg: dict, train: tuple, rollout_tp: int, dtype_name: str,
                 bucket_bytes: int, seed: int, repeats: int, with_naive: bool, push_model: str | None = None) -> dict:
    """Reshard on this rank, verify bit-exactly against the reference, and time all three paths."""
    import torch.distributed as dist

    from verl.hybrid_engine.executor import ReshardExecutor, ReshardProcessGroups
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.layouts import TrainingLayout
    from verl.hybrid_engine.planner import plan_reshard
    from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs

    config = ModelConfig.from_dict(cfg)
    training = TrainingLayout(*train)
    dtype = DTYPES[dtype_name]
    groups = derive_groups(training, rollout_tp)
    j = groups.rollout_tp_rank[rank]
    hf = random_hf_weights(config, seed, dtype)
    train_flat, offsets, train_views = build_training_buffer(config, training, rank, hf, dtype)
    plan = plan_reshard(config, training, RolloutLayout(rollout_tp), rank, bucket_bytes, dtype_name)
    executor = ReshardExecutor(plan, train_flat, offsets,
                               [(s.name, s.shape) for s in rollout_param_specs(config, rollout_tp, j)],
                               ReshardProcessGroups(groups))
    stats = executor.to_rollout()
    reference = sglang_shard(hf, config, rollout_tp, j)
    del hf
    got = executor.rollout_params()
    mismatched = [n for n, t in reference.items() if n not in got or not torch.equal(got[n], t)]
    result = {"rank": rank, "rollout_tp_rank": j, "case": plan.case, "verified": not mismatched,
              "mismatched": mismatched[:5], "bytes_received": plan.bytes_received, "bytes_sent": plan.bytes_sent,
              "bytes_formula": plan.bytes_formula, "model_bytes": plan.model_bytes,
              "peak_extra_bytes": stats.peak_extra_bytes, "metrics": stats.metrics(),
              "summary": plan.summary() if rank == 0 else None}
    # Executor released and reacquired between timings, as in a PPO iteration.
    executor.release()
    result["seconds"] = _timed(executor.to_rollout, repeats)
    if with_naive:
        tp_groups = {(s, d): dist.new_group([training.rank(s, d, r) for r in range(training.tp)])
                     for s in range(training.pp) for d in range(training.dp)}
        pp_groups = {(d, r): dist.new_group([training.rank(s, d, r) for s in range(training.pp)])
                     for d in range(training.dp) for r in range(training.tp)}

        def naive(params):
            naive_reshard(rank, config, training, rollout_tp, train_views, params, tp_groups, pp_groups)

        result.update(_time_naive(naive, executor, got, reference, dtype, repeats))
    del reference, got
    memcpy_src = torch.empty(executor.rollout_numel, dtype=dtype).normal_()
    rollout_flat = executor.acquire()
    result["memcpy_seconds"] = _timed(lambda: rollout_flat.copy_(memcpy_src), repeats)
    if push_model is not None:
        result.update(_time_sglang_push(rank, config, groups, executor, push_model, dtype, bucket_bytes, repeats))
    return result


# ------------------------------------------------------------------------------------------------
# FSDP2 training layout: a real fully_shard-ed transformers model
# ------------------------------------------------------------------------------------------------

def hf_causal_lm(config: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers CausalLM (Qwen2/Llama) of ``config``'s sizes, randomly initialised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {} if config.model_type == "qwen2" else {"attention_bias": config.attention_bias}
    hf_config = AutoConfig.for_model(
        config.model_type, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings, **extra)
    return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def build_fsdp_model(config: ModelConfig, shard: int, replicate: int, hf: dict[str, torch.Tensor],
                     dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """``hf_causal_lm`` with the weights ``hf``, then ``fully_shard`` per decoder layer and at the root over a
    ``(replicate, shard)`` mesh (1-D when replicate == 1): FSDP2 itself decides who holds what."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = hf_causal_lm(config, dtype)
    params = dict(model.named_parameters())
    if sorted(params) != sorted(hf) or any(tuple(params[n].shape) != tuple(t.shape) for n, t in hf.items()):
        raise RuntimeError(f"transformers model: expected the parameters {sorted(hf)[:4]}..., found "
                           f"{sorted((n, tuple(p.shape)) for n, p in params.items())[:4]}...")
    with torch.no_grad():
        for name, t in hf.items():
            params[name].copy_(t)
    if replicate == 1:
        mesh = init_device_mesh(device, (shard,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh(device, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def naive_fsdp_reshard(model: torch.nn.Module, config: ModelConfig, rollout_tp: int, j: int,
                       rollout_params: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """What verl's FSDP sharding manager does: per parameter ``full_tensor()`` (an all-gather of the whole
    tensor over the shard group), cast, then narrow/copy the rollout shard."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = param.full_tensor().to(dtype)
            for key, piece in sglang_shard_partial({name: full}, config, rollout_tp, j).items():
                target, row = key.rsplit(":", 1)
                rollout_params[target][int(row):int(row) + piece.shape[0]].copy_(piece)


def fsdp_reshard_rank(rank: int, nproc: int, cfg: dict, train: tuple, rollout_tp: int, dtype_name: str,
                      train_dtype_name: str, bucket_bytes: int, seed: int, repeats: int, with_naive: bool) -> dict:
    """FSDP2 -> rollout on this rank: reshard what HybridEngine reads (fsdp_reshard_sources), verify
    bit-exactly against the reference, and time it, the naive path and a memcpy."""
    from verl.hybrid_engine.executor import ReshardExecutor, ReshardProcessGroups
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.hybrid_engine import check_fsdp_module, fsdp_reshard_sources
    from verl.hybrid_engine.layouts import FSDPLayout
    from verl.hybrid_engine.planner import plan_reshard
    from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs

    config = ModelConfig.from_dict(cfg)
    training = FSDPLayout(*train)
    dtype, train_dtype = DTYPES[dtype_name], DTYPES[train_dtype_name]
    groups = derive_groups(training, rollout_tp)
    j = groups.rollout_tp_rank[rank]
    hf = random_hf_weights(config, seed, train_dtype)
    model = build_fsdp_model(config, training.shard, training.replicate, hf, train_dtype)
    reference = sglang_shard({n: t.to(dtype) for n, t in hf.items()}, config, rollout_tp, j)
    del hf
    check_fsdp_module(model, config, training, rank)
    plan = plan_reshard(config, training, RolloutLayout(rollout_tp), rank, bucket_bytes, dtype_name)
    sources = fsdp_reshard_sources(model, dtype, "cpu")
    locals_ = {n: p.to_local() for n, p in model.named_parameters()}
    in_place = all(s.data_ptr() == locals_[n].data_ptr() for n, s in sources.items() if s.numel())
    executor = ReshardExecutor(plan, sources, None,
                               [(s.name, s.shape) for s in rollout_param_specs(config, rollout_tp, j)],
                               ReshardProcessGroups(groups))
    stats = executor.to_rollout(sources=sources)
    del sources, locals_
    got = executor.rollout_params()
    mismatched = [n for n, t in reference.items() if n not in got or not torch.equal(got[n], t)]
    result = {"rank": rank, "rollout_tp_rank": j, "case": plan.case, "verified": not mismatched,
              "mismatched": mismatched[:5], "bytes_received": plan.bytes_received, "bytes_sent": plan.bytes_sent,
              "bytes_formula": plan.bytes_formula, "model_bytes": plan.model_bytes, "sources_in_place": in_place,
              "peak_extra_bytes": stats.peak_extra_bytes, "metrics": stats.metrics(),
              "summary": plan.summary() if rank == 0 else None}
    executor.release()

    def ours():  # a HybridEngine transition: fetch (cast only when dtypes differ) and reshard
        executor.to_rollout(sources=fsdp_reshard_sources(model, dtype, "cpu"))

    result["seconds"] = _timed(ours, repeats)
    if with_naive:
        result.update(_time_naive(lambda params: naive_fsdp_reshard(model, config, rollout_tp, j, params, dtype),
                                  executor, got, reference, dtype, repeats))
    del reference, got
    memcpy_src = torch.empty(executor.rollout_numel, dtype=dtype).normal_()
    rollout_flat = executor.acquire()
    result["memcpy_seconds"] = _timed(lambda: rollout_flat.copy_(memcpy_src), repeats)
    return result


def _time_sglang_push(rank: int, config: ModelConfig, groups, executor, model: str, dtype: torch.dtype,
                      bucket_bytes: int, repeats: int) -> dict:
    """The trainer's SGLang weight sync on this plan: reshard into each rank's shared buffer, then hand the
    buckets to the group's engine (``push_seconds``, the whole ``timing_s/update_weights``), and SGLang's own
    cost of one weight-update call, measured as a one-element push (``sglang_call_seconds``)."""

    from verl.engine.rollout.sglang_group import SGLangGroupRollout
    from verl.hybrid_engine.hybrid_engine import rollout_tp_process_group

    index, ranks, group = rollout_tp_process_group(groups, rank, backend="gloo")
    rollout = SGLangGroupRollout(config, model, ranks, group, dtype, bucket_bytes, group_index=index,
                                 num_groups=len(groups.rollout_tp_groups), max_rows=4, max_seq_len=64)
    try:
        def push():
            executor.to_rollout(into=rollout.weight_buffer())
            rollout.push_weights()
            executor.release()

        out = {"push_seconds": _timed(push, repeats), "push_buckets": len(rollout.ranges)}
        buckets, rollout.ranges = rollout.ranges, [(0, 1)]
        out["sglang_call_seconds"] = _timed(rollout.push_weights, repeats)
        rollout.ranges = buckets
        return out
    finally:
        rollout.shutdown()


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

def _parse_sizes(text: str, keys: Sequence[str], what: str) -> dict[str, int]:
    sizes = {k: 1 for k in keys}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in keys or not value.isdigit() or int(value) <= 0:
            raise ValueError(f"{what}: expected comma-separated {'/'.join(keys)}=<positive int>, found {item!r}")
        sizes[key] = int(value)
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl bench reshard", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF-style config.json (Qwen2/Llama)")
    p.add_argument("--train", required=True,
                   help="training layout: Megatron tp=2,pp=2,dp=1 or FSDP2 fsdp=4 (HSDP: fsdp=2,replicate=2)")
    p.add_argument("--rollout", required=True, help="rollout layout, e.g. tp=2")
    p.add_argument("--nproc", type=int, required=True, help="local gloo ranks to spawn (= tp*pp*dp or fsdp*replicate)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--train-dtype", choices=sorted(DTYPES), default=None,
                   help="FSDP only: the sharded parameters' dtype (default --dtype); another dtype times the cast")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    p.add_argument("--repeats", type=int, default=3, help="timings are best of this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-naive", action="store_true", help="skip timing the naive path")
    p.add_argument("--push", choices=["sglang"], default=None,
                   help="also time the trainer's weight sync into SGLang engines (reshard + per-rank push); needs "
                        "SGLang importable (.venv-sglang/bin/verl)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before every rank is killed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from verl.hybrid_engine.layouts import FSDPLayout, LayoutError, TrainingLayout, hf_tensor_shapes
    from verl.hybrid_engine.planner import plan_reshard
    from verl.hybrid_engine.rollout_layout import RolloutLayout, RolloutLayoutError

    try:
        config = ModelConfig.from_pretrained(args.model)
        fsdp = "fsdp=" in args.train
        rollout_tp = _parse_sizes(args.rollout, ("tp",), "--rollout")["tp"]
        if fsdp:
            train = _parse_sizes(args.train, ("fsdp", "replicate"), "--train")
            training = FSDPLayout(train["fsdp"], train["replicate"])
            if args.push:
                raise ValueError("--push: expected a Megatron --train layout (tp/pp/dp), found fsdp")
        else:
            train = _parse_sizes(args.train, ("tp", "pp", "dp"), "--train")
            training = TrainingLayout(train["tp"], train["pp"], train["dp"])
            if args.train_dtype not in (None, args.dtype):
                raise ValueError(f"--train-dtype: expected it only with --train fsdp=..., found {args.train_dtype} "
                                 "with a Megatron layout (its bench trains in --dtype)")
        if args.nproc != training.world_size:
            sizes = "fsdp*replicate" if fsdp else "tp*pp*dp"
            raise ValueError(f"--nproc: expected {sizes} = {training.world_size}, found {args.nproc}")
        if args.bucket_bytes <= 0 or args.repeats <= 0:
            raise ValueError(f"--bucket-bytes/--repeats: expected positive integers, found "
                             f"{args.bucket_bytes}/{args.repeats}")
        plan_reshard(config, training, RolloutLayout(rollout_tp), 0, args.bucket_bytes, args.dtype)
        if args.push == "sglang":
            from verl.engine.rollout.sglang_rollout import SGLangRolloutError, check_cpu_tp
            from verl.utils.sglang_env import sglang_importable

            if not sglang_importable():
                raise ValueError(f"--push sglang: expected SGLang importable by {sys.executable}, found none "
                                 "(bash launch/setup_sglang.sh, then .venv-sglang/bin/verl bench reshard ...)")
            if not torch.cuda.is_available():
                try:
                    check_cpu_tp(config, rollout_tp)
                except SGLangRolloutError as err:
                    raise ValueError(f"--push sglang: {err}") from None
    except (ModelConfigError, LayoutError, RolloutLayoutError, ValueError) as exc:
        print(f"verl bench reshard: {exc}", file=sys.stderr)
        return 2
    cfg = dataclasses.asdict(config)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if fsdp:
        train_dtype = args.train_dtype or args.dtype
        ranks = spawn_gloo_ranks(fsdp_reshard_rank, args.nproc,
                                 (cfg, (training.shard, training.replicate), rollout_tp, args.dtype, train_dtype,
                                  args.bucket_bytes, args.seed, args.repeats, not args.no_naive), args.timeout)
    else:
        ranks = spawn_gloo_ranks(reshard_rank, args.nproc,
                                 (cfg, (training.tp, training.pp, training.dp), rollout_tp, args.dtype,
                                  args.bucket_bytes, args.seed, args.repeats, not args.no_naive,
                                  os.path.abspath(args.model) if args.push else None), args.timeout)
    first = ranks[0]
    received = [r["bytes_received"] for r in ranks]
    seconds = first["seconds"]
    params = sum(math.prod(shape) for shape in hf_tensor_shapes(config).values())
    if fsdp:
        # FSDP's bound is per rank (uneven shards hold different amounts); the naive path all-gathers every
        # full tensor in the training dtype.
        per_rank = [r["bytes_formula"] for r in ranks]
        formula = sum(per_rank) / len(per_rank)
        naive_bytes = (1 - 1 / training.shard) * params * DTYPES[train_dtype].itemsize
    else:
        formula = first["bytes_formula"]
        naive_bytes = (1 - 1 / (training.tp * training.pp)) * first["model_bytes"]
    result = {
        "model": os.path.abspath(args.model),
        "train": train, "rollout": {"tp": rollout_tp}, "nproc": args.nproc, "dtype": args.dtype,
        "params": params,
        "verified": all(r["verified"] for r in ranks),
        "case": first["case"],
        "bytes_received_per_rank": received,
        "bytes_received_mean": sum(received) / len(received),
        "bytes_formula": formula,
        "model_bytes": first["model_bytes"],
        "naive_bytes_per_rank": naive_bytes,
        "seconds": seconds,
        "memcpy_seconds": first["memcpy_seconds"],
        "seconds_over_memcpy": seconds / first["memcpy_seconds"],
        "peak_extra_bytes": max(r["peak_extra_bytes"] for r in ranks),
        "bucket_bytes": args.bucket_bytes,
        "metrics": first["metrics"],
    }
    if fsdp:
        result.update(train_dtype=train_dtype, bytes_formula_per_rank=per_rank,
                      bytes_received_equals_formula=received == per_rank,
                      sources_in_place=all(r["sources_in_place"] for r in ranks))
    if not args.no_naive:
        result["naive_seconds"] = first["naive_seconds"]
        result["naive_verified"] = all(r["naive_verified"] for r in ranks)
        result["naive_over_seconds"] = first["naive_seconds"] / seconds
    if args.push:
        # Acceptance of a push: at most twice the in-place reshard of the same plan plus one SGLang call.
        budget = 2 * seconds + first["sglang_call_seconds"]
        result.update(push_seconds=first["push_seconds"], push_buckets=first["push_buckets"],
                      sglang_call_seconds=first["sglang_call_seconds"], push_budget_seconds=budget,
                      push_over_budget=first["push_seconds"] / budget)
    if not result["verified"]:
        result["mismatched"] = {r["rank"]: r["mismatched"] for r in ranks if not r["verified"]}
    print(first["summary"])
    if fsdp:
        print("bytes received per rank vs formula: "
              + ", ".join(f"rank {r}: {got} / {want:.0f}" for r, (got, want) in enumerate(zip(received, per_rank,
                                                                                               strict=True))))
    print(json.dumps({k: v for k, v in result.items() if k != "metrics"}, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
