"""`verl bench reshard`: the 3D-HybridEngine against the naive gather-everything path, verified.

    verl bench reshard --model CONFIG.json --train tp=T,pp=P,dp=D --rollout tp=G --nproc N --json PATH
    verl bench reshard --model MOE.json --train tp=T,pp=P,dp=D,ep=E[,etp=F] --rollout tp=G --nproc N
    verl bench reshard --model CONFIG.json --train fsdp=S[,replicate=R] --rollout tp=G --nproc S*R
    verl bench reshard ... --rollout tp=G --rollout-replicas R --placement separate --nproc N_train+G*R
        (a standalone rollout pool: verl.bench.weight_sync)

Spawns N local gloo ranks. Every rank builds the same seeded full HF weight set, takes its Megatron
training shard from it (the HF -> Megatron converter), reshards into the SGLang rollout layout with
the planner + executor, and checks the result bit-exactly against the rollout shard cut directly
from the full HF weights. The same run times the naive path (per-tensor TP all-gather + PP broadcast
-> HF tensors by the converter's merge -> per-rank narrow/copy, what today's frameworks do) and a
memcpy of the rollout shard's bytes.

With ``fsdp=``, the training side is a real FSDP2 model (a transformers CausalLM with those weights,
``fully_shard`` per decoder layer and at the root, HSDP with ``replicate``); the naive path is verl's
per-parameter ``full_tensor()`` then narrow/copy, and each rank's bytes received are compared with
its own bound (its rollout shard minus what its FSDP shard already holds of it).

Everything model-specific comes from the model spec: the weight names and shapes, the converter, and
the run-time reference (each rollout parameter cut from the full weights by its rollout layout pieces,
``layouts.fill_local``), which checks the plan's intersections, buckets, collectives and copy programs.
The independent pure-torch oracle of the layouts themselves is in the tests (``tests/helpers/reshard_oracle``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

import torch

from verl.bench.reshard_reference import (
    copy_into_rollout,
    random_hf_weights,
    reference_rollout_shard,
    rollout_targets,
    timed,
)
from verl.errors import InputError, refuse
from verl.hybrid_engine.planner import DEFAULT_BUCKET_BYTES
from verl.models.config import ModelConfig
from verl.utils.device import is_cuda_available
from verl.utils.torch_dtypes import DTYPES

# ------------------------------------------------------------------------------------------------
# Weights and the run-time reference, from the model spec
# ------------------------------------------------------------------------------------------------

# ------------------------------------------------------------------------------------------------
# Local gloo ranks
# ------------------------------------------------------------------------------------------------

def spawn_gloo_ranks(fn, nproc: int, args: tuple = (), timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` local gloo ranks, one thread each; the first rank
    failure, or the timeout, ends every rank and raises."""
    from verl.launcher.spawn import run_ranks_with_rank

    return run_ranks_with_rank(fn, nproc, *args, timeout_s=timeout_s, threads_per_rank=1)


def rank_device(device: str, rank: int) -> torch.device:
    """``cpu``, or this rank's GPU (rank r on GPU r mod the GPUs there, as the trainer's bootstrap pins ranks)."""
    if device != "cuda":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective_backend(device: torch.device, nproc: int) -> str:
    """NCCL between ranks that each have a GPU of their own; gloo on CPU and for ranks sharing a GPU (NCCL
    refuses two ranks on one device; gloo moves CUDA tensors), as ``verl.utils.device.dist_backend``."""
    if device.type == "cuda" and nproc <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


class BackendReshardGroups:
    """The plan's collective groups (``ReshardProcessGroups``' interface) on ``backend``, the world included:
    the ranks join gloo (``run_ranks``), and the reshard's collectives run on NCCL groups beside it."""

    def __init__(self, groups, backend: str):
        import torch.distributed as dist

        self._groups = {ranks: dist.new_group(list(ranks), backend=backend)  # same order on every rank
                        for ranks in groups.micro_dp_groups}

    def get(self, ranks: tuple[int, ...]):
        return self._groups[ranks]


# ------------------------------------------------------------------------------------------------
# The naive path (today's frameworks): gather every tensor to full size, rename, narrow
# ------------------------------------------------------------------------------------------------

def naive_reshard(rank: int, config: ModelConfig, training, rollout_tp: int, train: dict[str, torch.Tensor],
                  rollout_params: dict[str, torch.Tensor], tp_groups: dict, pp_groups: dict,
                  world_group=None) -> None:
    """Per-tensor TP all-gather + PP broadcast to full size -> HF tensors (the converter's merge) -> narrow/copy.
    ``world_group``: where the experts' broadcasts run (None: the default group)."""
    import torch.distributed as dist

    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.layouts import training_param_specs
    from verl.models.mcore.weights import REPLICATED, weight_rules

    tp, pp = training.tp, training.pp
    my_stage, dp, r = training.coords(rank)
    _, my_ep, my_etp = training.expert_coords(rank)
    targets = rollout_targets(config, rollout_tp, derive_groups(training, rollout_tp).rollout_tp_rank[rank])
    first = next(iter(train.values()))
    copied: set[str] = set()  # a tied output layer on the last stage repeats the embedding
    for stage in range(pp):
        specs = training_param_specs(config, tp, pp, r, stage, training.ep, 0, training.etp, 0)
        for rule, (name, shape) in zip(weight_rules(config, pp, stage, "lm", training.ep, 0), specs, strict=True):
            if rule.expert is not None:
                continue  # experts below
            split = tp > 1 and rule.layout is not REPLICATED
            if stage == my_stage:
                local = train[name]
                if split:
                    parts = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(parts, local, group=tp_groups[(stage, dp)])
                    gathered = torch.cat(parts)
                else:
                    gathered = local
            else:
                rows = shape[0] * tp if split else shape[0]
                gathered = torch.empty((rows, *shape[1:]), dtype=first.dtype, device=first.device)
            if pp > 1:
                dist.broadcast(gathered, src=training.rank(stage, dp, r), group=pp_groups[(dp, r)])
            merged = rule.layout.merge(gathered.chunk(tp) if split else [gathered], config)
            for hf_name, t in zip(rule.hf, merged, strict=True):
                if hf_name not in copied:
                    copied.add(hf_name)
                    copy_into_rollout(hf_name, t, targets, rollout_params)
        # Experts: each full expert tensor from its first expert-DP replica's etp ranks, broadcast to everyone.
        etp, base = training.expert_tp, stage * tp * training.dp
        for e in range(training.ep):
            specs = training_param_specs(config, tp, pp, r, stage, training.ep, e, training.etp, 0)
            for rule, (name, shape) in zip(weight_rules(config, pp, stage, "lm", training.ep, e), specs, strict=True):
                if rule.expert is None:
                    continue
                parts = []
                for k in range(etp):
                    holder = base + e * etp + k
                    part = train[name] if rank == holder else torch.empty(shape, dtype=first.dtype,
                                                                           device=first.device)
                    dist.broadcast(part, src=holder, group=world_group)
                    parts.append(part)
                for hf_name, t in zip(rule.hf, rule.layout.merge(parts, config), strict=True):
                    copy_into_rollout(hf_name, t, targets, rollout_params)


# ------------------------------------------------------------------------------------------------
# One benchmark rank
# ------------------------------------------------------------------------------------------------

def _time_naive(reshard, executor, got: dict, reference: dict, dtype: torch.dtype, repeats: int) -> dict:
    """Best-of-``repeats`` time of a naive reshard ``reshard(params)`` into buffers of the rollout's layout, and
    whether it matches ``reference``: the baseline both the Megatron and the FSDP benchmark report."""
    naive_flat = torch.zeros(executor.rollout_numel, dtype=dtype, device=executor.device)
    naive_params = {n: naive_flat[o:o + t.numel()].view(t.shape)
                    for (n, o), t in zip(executor.rollout_offsets.items(), got.values(), strict=False)}
    seconds = timed(lambda: reshard(naive_params), repeats, executor.device)
    return {"naive_seconds": seconds,
            "naive_verified": all(torch.equal(naive_params[n], t) for n, t in reference.items())}


def build_training_buffer(config: ModelConfig, training, rank: int, shard: dict[str, torch.Tensor],
                          dtype: torch.dtype, device: torch.device | str = "cpu"):
    """(flat buffer, offsets, views) of this rank's Megatron state dict ``shard``, in training_param_specs order."""
    from verl.hybrid_engine.executor import flat_offsets
    from verl.hybrid_engine.layouts import training_param_specs

    stage, _, r = training.coords(rank)
    _, ep_rank, etp_rank = training.expert_coords(rank)
    specs = training_param_specs(config, training.tp, training.pp, r, stage, training.ep, ep_rank, training.etp,
                                 etp_rank)
    found = [(n, tuple(t.shape)) for n, t in shard.items()]
    if [(s.name, tuple(s.shape)) for s in specs] != found:
        raise RuntimeError(f"training layout: expected the reference Megatron shard {found}, found specs {specs}")
    offsets, numel = flat_offsets(specs)
    flat = torch.empty(numel, dtype=dtype, device=device)
    views = {}
    for name, shape in specs:
        views[name] = flat[offsets[name]:offsets[name] + shard[name].numel()].view(shape)
        views[name].copy_(shard[name])
    return flat, offsets, views


def reshard_rank(rank: int, nproc: int, cfg: dict, train: tuple, rollout_tp: int, dtype_name: str,
                 bucket_bytes: int, seed: int, repeats: int, with_naive: bool, push_model: str | None = None,
                 device_name: str = "cpu") -> dict:
    """Reshard on this rank, verify bit-exactly against the reference, and time all three paths. ``device_name``
    cuda: every buffer on this rank's GPU, the collectives on NCCL (gloo where ranks share a GPU)."""
    import torch.distributed as dist

    from verl.hybrid_engine.executor import ReshardExecutor, ReshardProcessGroups
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.layouts import TrainingLayout
    from verl.hybrid_engine.planner import plan_reshard
    from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs

    config = ModelConfig.from_fields(cfg)
    training = TrainingLayout(*train)
    dtype = DTYPES[dtype_name]
    groups = derive_groups(training, rollout_tp)
    j = groups.rollout_tp_rank[rank]
    from verl.models.mcore.weights import to_mcore_shard

    device = rank_device(device_name, rank)
    backend = collective_backend(device, nproc)
    # gloo is the rendezvous's backend (run_ranks): other backends get groups of their own.
    process_groups = ReshardProcessGroups(groups) if backend == "gloo" else BackendReshardGroups(groups, backend)
    hf = random_hf_weights(config, seed, dtype, device)
    stage, _, r = training.coords(rank)
    _, ep_rank, etp_rank = training.expert_coords(rank)
    shard = to_mcore_shard(config, hf.__getitem__, training.tp, training.pp, r, stage, "lm", training.ep, ep_rank,
                           training.expert_tp, etp_rank)
    train_flat, offsets, train_views = build_training_buffer(config, training, rank, shard, dtype, device)
    del shard
    plan = plan_reshard(config, training, RolloutLayout(rollout_tp), rank, bucket_bytes, dtype_name)
    executor = ReshardExecutor(plan, train_flat, offsets,
                               [(s.name, s.shape) for s in rollout_param_specs(config, rollout_tp, j)],
                               process_groups)
    stats = executor.to_rollout()
    reference = reference_rollout_shard(config, hf, rollout_tp, j, dtype, device)
    del hf
    got = executor.rollout_params()
    mismatched = [n for n, t in reference.items() if n not in got or not torch.equal(got[n], t)]
    result = {"rank": rank, "rollout_tp_rank": j, "case": plan.case, "verified": not mismatched,
              "mismatched": mismatched[:5], "bytes_received": plan.bytes_received, "bytes_sent": plan.bytes_sent,
              "bytes_formula": plan.bytes_formula, "model_bytes": plan.model_bytes,
              "expert_bytes": plan.expert_bytes,
              "peak_extra_bytes": stats.peak_extra_bytes, "metrics": stats.metrics(),
              "device": str(device), "backend": backend,
              "summary": plan.summary() if rank == 0 else None}
    # Executor released and reacquired between timings, as in a PPO iteration.
    executor.release()
    result["seconds"] = timed(executor.to_rollout, repeats, device)
    if with_naive:
        extra = {} if backend == "gloo" else {"backend": backend}
        tp_groups = {(s, d): dist.new_group([training.rank(s, d, r) for r in range(training.tp)], **extra)
                     for s in range(training.pp) for d in range(training.dp)}
        pp_groups = {(d, r): dist.new_group([training.rank(s, d, r) for s in range(training.pp)], **extra)
                     for d in range(training.dp) for r in range(training.tp)}
        world_group = dist.new_group(list(range(nproc)), **extra) if extra else None

        def naive(params):
            naive_reshard(rank, config, training, rollout_tp, train_views, params, tp_groups, pp_groups,
                          world_group)

        result.update(_time_naive(naive, executor, got, reference, dtype, repeats))
    del reference, got
    memcpy_src = torch.empty(executor.rollout_numel, dtype=dtype, device=device).normal_()
    rollout_flat = executor.acquire()
    result["memcpy_seconds"] = timed(lambda: rollout_flat.copy_(memcpy_src), repeats, device)
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
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def naive_fsdp_reshard(model: torch.nn.Module, config: ModelConfig, rollout_tp: int, j: int,
                       rollout_params: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """What verl's FSDP sharding manager does: per parameter ``full_tensor()`` (an all-gather of the whole
    tensor over the shard group), cast, then narrow/copy the rollout shard."""
    targets = rollout_targets(config, rollout_tp, j)
    with torch.no_grad():
        for name, param in model.named_parameters():
            copy_into_rollout(name, param.full_tensor().to(dtype), targets, rollout_params)


def fsdp_reshard_rank(rank: int, nproc: int, cfg: dict, train: tuple, rollout_tp: int, dtype_name: str,
                      train_dtype_name: str, bucket_bytes: int, seed: int, repeats: int, with_naive: bool) -> dict:
    """FSDP2 -> rollout on this rank: reshard what HybridEngine reads (fsdp_reshard_sources), verify
    bit-exactly against the reference, and time it, the naive path and a memcpy."""
    from verl.engine.fsdp.reshard import check_fsdp_module, fsdp_reshard_sources
    from verl.hybrid_engine.executor import ReshardExecutor, ReshardProcessGroups
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.layouts import FSDPLayout
    from verl.hybrid_engine.planner import plan_reshard
    from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs

    config = ModelConfig.from_fields(cfg)
    training = FSDPLayout(*train)
    dtype, train_dtype = DTYPES[dtype_name], DTYPES[train_dtype_name]
    groups = derive_groups(training, rollout_tp)
    j = groups.rollout_tp_rank[rank]
    hf = random_hf_weights(config, seed, train_dtype)
    model = build_fsdp_model(config, training.shard, training.replicate, hf, train_dtype)
    reference = reference_rollout_shard(config, hf, rollout_tp, j, dtype)
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
              "bytes_formula": plan.bytes_formula, "model_bytes": plan.model_bytes,
              "expert_bytes": plan.expert_bytes, "sources_in_place": in_place,
              "peak_extra_bytes": stats.peak_extra_bytes, "metrics": stats.metrics(),
              "summary": plan.summary() if rank == 0 else None}
    executor.release()

    def ours():  # a HybridEngine transition: fetch (cast only when dtypes differ) and reshard
        executor.to_rollout(sources=fsdp_reshard_sources(model, dtype, "cpu"))

    result["seconds"] = timed(ours, repeats)
    if with_naive:
        result.update(_time_naive(lambda params: naive_fsdp_reshard(model, config, rollout_tp, j, params, dtype),
                                  executor, got, reference, dtype, repeats))
    del reference, got
    memcpy_src = torch.empty(executor.rollout_numel, dtype=dtype).normal_()
    rollout_flat = executor.acquire()
    result["memcpy_seconds"] = timed(lambda: rollout_flat.copy_(memcpy_src), repeats)
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

        out = {"push_seconds": timed(push, repeats), "push_buckets": len(rollout.ranges)}
        buckets, rollout.ranges = rollout.ranges, [(0, 1)]
        out["sglang_call_seconds"] = timed(rollout.push_weights, repeats)
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
            raise InputError(f"{what}: expected comma-separated {'/'.join(keys)}=<positive int>, found {item!r}")
        sizes[key] = int(value)
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl bench reshard", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF-style config.json (Qwen2/Llama/Qwen3/Qwen3-MoE)")
    p.add_argument("--train", required=True,
                   help="training layout: Megatron tp=2,pp=2,dp=1 (MoE: ,ep=2[,etp=1]) or FSDP2 fsdp=4 (HSDP: "
                        "fsdp=2,replicate=2)")
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
    p.add_argument("--lora-rank", type=int, default=0,
                   help="also the LoRA adapter-only sync of rank R adapters on every decoder linear (colocated, "
                        "Megatron --train): its bytes, formula and time beside the dense figures")
    p.add_argument("--push", choices=["sglang"], default=None,
                   help="also time the trainer's weight sync into SGLang engines (reshard + per-rank push); needs "
                        "SGLang importable (.venv-sglang/bin/verl)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before every rank is killed")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where every buffer lives (cuda: rank r on GPU r mod the GPUs, timed to completion; NCCL "
                        "between ranks with a GPU each, gloo where ranks share one). Megatron layouts, colocated")
    p.add_argument("--placement", choices=["colocated", "separate"], default="colocated",
                   help="separate: the rollout on ranks of its own after the training ranks (--nproc counts both "
                        "pools); see verl.bench.weight_sync")
    p.add_argument("--rollout-replicas", type=int, default=1, help="separate: rollout replicas (rollout TP groups)")
    p.add_argument("--delta-after-steps", type=int, default=0,
                   help="separate: after the dense sync, K Adam steps then a sparse-delta sync (delta_fraction)")
    p.add_argument("--lr", type=float, default=1e-6, help="separate: the Adam steps' learning rate (verl's default)")
    p.add_argument("--no-verify", action="store_true",
                   help="separate: no bucket checksums (checkpoint_engine.verify=false); the result is still "
                        "compared with the reference")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not is_cuda_available():
        return refuse("verl bench reshard", "--device cuda: expected a CUDA device, found none")
    from verl.hybrid_engine.layouts import FSDPLayout, TrainingLayout, hf_tensor_shapes
    from verl.hybrid_engine.planner import plan_reshard
    from verl.hybrid_engine.rollout_layout import RolloutLayout

    try:
        config = ModelConfig.from_pretrained(args.model)
        fsdp = "fsdp=" in args.train
        if args.device == "cuda" and (fsdp or args.placement == "separate" or args.push):
            raise InputError("--device cuda: expected a Megatron --train layout, --placement colocated and no --push "
                             f"(the others run on CPU ranks), found --train {args.train} --placement "
                             f"{args.placement}{' --push ' + args.push if args.push else ''}")
        rollout_tp = _parse_sizes(args.rollout, ("tp",), "--rollout")["tp"]
        if fsdp:
            train = _parse_sizes(args.train, ("fsdp", "replicate"), "--train")
            training = FSDPLayout(train["fsdp"], train["replicate"])
            if args.push:
                raise InputError("--push: expected a Megatron --train layout (tp/pp/dp), found fsdp")
        else:
            train = _parse_sizes(args.train, ("tp", "pp", "dp", "ep", "etp"), "--train")
            if "etp=" not in args.train:
                train["etp"] = train["tp"]  # megatron's default
            training = TrainingLayout(train["tp"], train["pp"], train["dp"], train["ep"],
                                      None if train["etp"] == train["tp"] else train["etp"])
            training.check(config)
            if args.train_dtype not in (None, args.dtype):
                raise InputError(f"--train-dtype: expected it only with --train fsdp=..., found {args.train_dtype} "
                                 "with a Megatron layout (its bench trains in --dtype)")
        if args.lora_rank and (fsdp or args.placement != "colocated" or args.lora_rank < 0):
            raise InputError(f"--lora-rank: expected a positive rank with a colocated Megatron --train layout, found "
                             f"{args.lora_rank} with {args.train} ({args.placement})")
        if args.placement == "separate":
            if not fsdp and (training.ep > 1 or training.etp is not None):
                raise InputError("--placement separate: expected ep=1 (the cross-pool sync of experts is not "
                                 f"benchmarked yet), found ep={training.ep} etp={training.expert_tp}")
            return _separate(args, config, train, training, rollout_tp)
        if args.rollout_replicas != 1 or args.delta_after_steps:
            raise InputError("--rollout-replicas/--delta-after-steps: expected them only with --placement separate")
        if args.nproc != training.world_size:
            sizes = "fsdp*replicate" if fsdp else "tp*pp*dp"
            raise InputError(f"--nproc: expected {sizes} = {training.world_size}, found {args.nproc}")
        if args.bucket_bytes <= 0 or args.repeats <= 0:
            raise InputError(f"--bucket-bytes/--repeats: expected positive integers, found "
                             f"{args.bucket_bytes}/{args.repeats}")
        plan_reshard(config, training, RolloutLayout(rollout_tp), 0, args.bucket_bytes, args.dtype)
        if args.push == "sglang":
            from verl.engine.rollout.sglang_rollout import SGLangRolloutError, check_cpu_tp
            from verl.utils.engine_env import sglang_importable

            if not sglang_importable():
                raise InputError(f"--push sglang: expected SGLang importable by {sys.executable}, found none "
                                 "(bash launch/setup_sglang.sh, then .venv-sglang/bin/verl bench reshard ...)")
            if not is_cuda_available():
                try:
                    check_cpu_tp(config, rollout_tp)
                except SGLangRolloutError as err:
                    raise InputError(f"--push sglang: {err}") from None
    except InputError as exc:  # ModelConfigError, LayoutError, RolloutLayoutError, the flag checks above
        return refuse("verl bench reshard", exc)
    cfg = config.to_fields()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if fsdp:
        train_dtype = args.train_dtype or args.dtype
        ranks = spawn_gloo_ranks(fsdp_reshard_rank, args.nproc,
                                 (cfg, (training.shard, training.replicate), rollout_tp, args.dtype, train_dtype,
                                  args.bucket_bytes, args.seed, args.repeats, not args.no_naive), args.timeout)
    else:
        ranks = spawn_gloo_ranks(reshard_rank, args.nproc,
                                 (cfg, (training.tp, training.pp, training.dp, training.ep, training.etp), rollout_tp,
                                  args.dtype,
                                  args.bucket_bytes, args.seed, args.repeats, not args.no_naive,
                                  os.path.abspath(args.model) if args.push else None, args.device), args.timeout)
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
        # Dense tensors: the TP all-gather and PP broadcast; experts: every full expert broadcast to everyone.
        experts = first["expert_bytes"]
        naive_bytes = ((1 - 1 / (training.tp * training.pp)) * (first["model_bytes"] - experts)
                       + (1 - 1 / (training.pp * training.ep * training.expert_tp)) * experts)
    result = {
        "model": os.path.abspath(args.model),
        "train": train, "rollout": {"tp": rollout_tp}, "nproc": args.nproc, "dtype": args.dtype,
        "device": args.device, **({"backend": first["backend"]} if "backend" in first else {}),
        "params": params,
        "verified": all(r["verified"] for r in ranks),
        "case": first["case"],
        "bytes_received_per_rank": received,
        "bytes_received_mean": sum(received) / len(received),
        "bytes_formula": formula,
        "model_bytes": first["model_bytes"],
        **({"expert_bytes": first["expert_bytes"]} if not fsdp else {}),
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
    if args.lora_rank:  # issue 45: the adapter-only sync of the same layouts, beside the dense figures
        from verl.bench.lora_sync import colocated_lora_rank, lora_summary

        lora_ranks = spawn_gloo_ranks(colocated_lora_rank, args.nproc,
                                      (cfg, (training.tp, training.pp, training.dp), rollout_tp, args.lora_rank,
                                       args.dtype, args.bucket_bytes, args.seed, args.repeats), args.timeout)
        result.update(lora_summary(lora_ranks, args.lora_rank, result))
        print(f"LoRA r={args.lora_rank}: adapter-only sync {result['lora_bytes_received_mean']:.0f} bytes received "
              f"per rank (formula {result['lora_bytes_formula']:.0f}) vs dense {result['bytes_received_mean']:.0f}; "
              f"{result['lora_seconds'] * 1e3:.1f} ms (merge {result['lora_merge_seconds'] * 1e3:.1f} ms) vs dense "
              f"{seconds * 1e3:.1f} ms; verified {result['lora_verified']}")
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


def _separate(args, config: ModelConfig, train: dict, training, rollout_tp: int) -> int:
    """``--placement separate``: the cross-pool sync (verl.bench.weight_sync), checked and reported."""
    from verl.bench.weight_sync import report, separate_rank
    from verl.hybrid_engine.cross_pool import PoolPlacement, plan_cross_pool

    if args.push or args.train_dtype not in (None, args.dtype):
        raise InputError("--push/--train-dtype: expected them only with --placement colocated")
    if args.rollout_replicas < 1 or args.delta_after_steps < 0 or args.lr <= 0:
        raise InputError(f"--rollout-replicas/--delta-after-steps/--lr: expected >= 1 / >= 0 / > 0, found "
                         f"{args.rollout_replicas}/{args.delta_after_steps}/{args.lr}")
    placement = PoolPlacement(training, rollout_tp, args.rollout_replicas)
    if args.nproc != placement.world_size:
        raise InputError(f"--nproc: expected the training ranks + rollout tp x replicas = {placement.n_training} + "
                         f"{rollout_tp} x {args.rollout_replicas} = {placement.world_size}, found {args.nproc}")
    if args.bucket_bytes <= 0 or args.repeats <= 0:
        raise InputError(f"--bucket-bytes/--repeats: expected positive integers, found {args.bucket_bytes}/"
                         f"{args.repeats}")
    plan_cross_pool(config, placement, 0, args.bucket_bytes, args.dtype)  # a layout the model cannot take: exit 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ranks = spawn_gloo_ranks(separate_rank, args.nproc,
                             (config.to_fields(), train, rollout_tp, args.rollout_replicas, args.dtype,
                              args.bucket_bytes, args.seed, args.repeats, not args.no_naive, args.delta_after_steps,
                              args.lr, not args.no_verify), args.timeout)
    result = report(ranks, placement, args, config)
    result["model"] = os.path.abspath(args.model)
    print(ranks[0]["summary"])
    print(ranks[placement.n_training]["summary"])
    print(f"bytes formula: {result['bytes_formula']['text']}")
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    ok = (result["verified"] and result.get("delta_verified", True) and result.get("naive_verified", True)
          and result.get("bucketed_verified", True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
