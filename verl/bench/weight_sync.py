"""`verl bench reshard --placement separate`: the cross-pool weight sync against the peers' way, verified.

    verl bench reshard --model CONFIG.json --train tp=2,pp=1,dp=1 --rollout tp=1 --rollout-replicas 2 \\
        --placement separate --nproc 4 --json F [--delta-after-steps K]

``--nproc`` counts both pools: the training ranks (tp*pp*dp or fsdp*replicate) come first, then
``rollout tp x replicas`` rollout ranks. Every rank builds the same seeded full HF weights (std 0.02, as
HF initialises); training ranks take their shard (Megatron: the HF -> Megatron converter; FSDP: the row
chunks ``fully_shard`` keeps), rollout ranks a staging buffer and the reference shard cut straight from
the full weights. Reported:

* ``verified``: every rollout rank's staging buffer equals its reference bit for bit after the sync;
* ``bytes_received_per_rank`` (rollout ranks), ``bytes_sent_per_rank`` (training ranks) and, when replicas
  forward (R*t_g > N_t), ``bytes_forwarded_per_rank``, against ``bytes_formula`` (:meth:`CrossPoolPlan.formula`);
* ``seconds`` (best of ``--repeats``), ``naive_seconds``: the peers' way in the same run -- each full
  tensor gathered on training rank 0 (point-to-point from the ranks holding its pieces) and broadcast to
  every rollout rank, which narrows out its shard -- also verified; ``memcpy_seconds`` of one shard;
* ``peak_extra_bytes_training``: the sender's scratch (two buckets), the delta cache reported apart;
* with ``--delta-after-steps K``: K Adam steps (``--lr``, verl's default 1e-6; random gradients, the same on
  every rank) move the fp32 master weights, the training shards are rebuilt, and a delta sync follows:
  ``delta_fraction`` (bytes sent / dense bytes) and ``delta_verified`` (bit-exact against the new reference).
"""

from __future__ import annotations

import math
import time

import torch

from verl.models.config import ModelConfig
from verl.utils.torch_dtypes import DTYPES

INIT_STD = 0.02  # HF's initializer_range: what decides how many bf16 values an optimizer step changes


def _layout(train: dict):
    from verl.hybrid_engine.layouts import FSDPLayout, TrainingLayout

    if "fsdp" in train:
        return FSDPLayout(train["fsdp"], train.get("replicate", 1))
    return TrainingLayout(train.get("tp", 1), train.get("pp", 1), train.get("dp", 1))


def training_shard(config: ModelConfig, training, rank: int, hf: dict[str, torch.Tensor], dtype: torch.dtype):
    """(flat buffer, offsets) for a Megatron rank, or ({name: 1-D local chunk}, None) for an FSDP rank."""
    from verl.hybrid_engine.layouts import FSDPLayout, fill_local, hf_tensor_shapes, local_shape

    if isinstance(training, FSDPLayout):
        shapes = hf_tensor_shapes(config)
        _, _, s = training.coords(rank)
        out = {}
        for param in training.params(config):
            local = torch.empty(math.prod(local_shape(param, shapes, training.shard, s)), dtype=dtype)
            fill_local(param, shapes, training.shard, s, local, lambda n: hf[n].to(dtype))
            out[param.name] = local
        return out, None
    from verl.bench.reshard import build_training_buffer
    from verl.models.mcore.weights import to_mcore_shard

    stage, _, r = training.coords(rank)
    shard = to_mcore_shard(config, lambda n: hf[n].to(dtype), training.tp, training.pp, r, stage)
    flat, offsets, _ = build_training_buffer(config, training, rank, shard, dtype)
    return flat, offsets


def _refill(target, fresh) -> None:
    """New weights into the training tensors the sender is bound to, in place (as an optimizer step does)."""
    if isinstance(target, torch.Tensor):
        target.copy_(fresh)
    else:
        for name, t in target.items():
            t.copy_(fresh[name])


def adam_steps(hf: dict[str, torch.Tensor], steps: int, lr: float, seed: int) -> None:
    """``steps`` Adam updates of the fp32 weights with random gradients (the same on every rank): the size of
    change an RL step makes at learning rate ``lr`` (Adam's update is ~lr per element whatever the gradient)."""
    gen = torch.Generator().manual_seed(seed + 1)
    params = [torch.nn.Parameter(t) for t in hf.values()]
    optimizer = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    for name, p in zip(list(hf), params, strict=True):
        hf[name] = p.detach()


def naive_sync(config: ModelConfig, training, placement, rank: int, bridge, source, offsets,
               rollout_params: dict[str, torch.Tensor] | None, broadcast_group, dtype: torch.dtype) -> None:
    """The peers' way: each full HF tensor gathered on training rank 0, broadcast to every rollout rank, narrowed.

    Pieces come from DP replica 0's holders (one per distinct rectangle), point to point over the bridge."""
    import torch.distributed as dist

    from verl.bench.reshard import copy_into_rollout, rollout_targets
    from verl.hybrid_engine.layouts import as_matrix, hf_tensor_shapes
    from verl.hybrid_engine.planner import _tables
    from verl.hybrid_engine.rollout_layout import RolloutLayout

    tables = _tables(config, training, RolloutLayout(1))
    role, _, j = placement.role(rank)
    targets = rollout_targets(config, placement.rollout_tp, j) if role == "rollout" else None
    for name, shape in hf_tensor_shapes(config).items():
        rows, cols = as_matrix(shape)
        full = torch.empty(rows, cols, dtype=dtype) if rank == 0 or role == "rollout" else None
        seen, works, keep = set(), [], []
        for held in tables.holders[name]:
            piece = held.piece
            rect = (piece.row, piece.col, piece.rows, piece.cols)
            if rect in seen:
                continue
            seen.add(rect)
            holder = training.rank(held.stage, 0, held.tp)
            if rank == holder:
                local = (source[offsets[held.param]:] if offsets is not None else source[held.param])
                block = local[:(piece.local_row + piece.rows) * held.stride].view(-1, held.stride)[
                    piece.local_row:piece.local_row + piece.rows, piece.local_col:piece.local_col + piece.cols]
                if rank == 0:
                    full[piece.row:piece.row + piece.rows, piece.col:piece.col + piece.cols].copy_(block)
                else:
                    keep.append(block.contiguous())
                    works.append(bridge.isend(keep[-1], 0, 3))
            elif rank == 0:
                recv = torch.empty(piece.rows, piece.cols, dtype=dtype)
                bridge.irecv(recv, holder, 3).wait()
                full[piece.row:piece.row + piece.rows, piece.col:piece.col + piece.cols].copy_(recv)
        for work in works:
            work.wait()
        if rank == 0 or role == "rollout":
            dist.broadcast(full, src=0, group=broadcast_group)
        if role == "rollout" and name in targets:  # a rank may hold only vocab padding of a small table
            copy_into_rollout(name, full.view(shape), targets, rollout_params)


def separate_rank(rank: int, nproc: int, cfg: dict, train: dict, rollout_tp: int, replicas: int, dtype_name: str,
                  bucket_bytes: int, seed: int, repeats: int, with_naive: bool, delta_steps: int = 0,
                  lr: float = 1e-6, verify: bool = True) -> dict:
    """One rank of the separate-placement bench (and of the tests' matrix): sync, verify, time."""
    import torch.distributed as dist

    from verl.bench.reshard import _timed, random_hf_weights, reference_rollout_shard
    from verl.hybrid_engine.cross_pool import ROLLOUT, PoolPlacement, plan_cross_pool
    from verl.hybrid_engine.rollout_layout import rollout_param_specs
    from verl.hybrid_engine.weight_sync import PoolReceiver, PoolSender
    from verl.launcher.pools import Bridge

    config = ModelConfig.from_fields(cfg)
    placement = PoolPlacement(_layout(train), rollout_tp, replicas)
    dtype = DTYPES[dtype_name]
    bridge = Bridge(dist.distributed_c10d._get_default_group(), rank, nproc)
    hf = random_hf_weights(config, seed)
    for t in hf.values():
        t.mul_(INIT_STD)  # in place: one fp32 copy of the model per rank, not two (4 ranks of a 0.5B model)
    plan = plan_cross_pool(config, placement, rank, bucket_bytes, dtype_name)
    role, replica, j = placement.role(rank)
    result = {"rank": rank, "role": role, "replica": replica, "tp_rank": j, "bytes": plan.bytes,
              "forwarded": plan.forwarded_bytes,
              "summary": plan.summary() if rank in (0, placement.n_training) else None,
              "formula": plan.formula() if rank == 0 else None}
    sender = receiver = staging = live = reference = source = offsets = None
    if role == ROLLOUT:
        specs = [(s.name, s.shape) for s in rollout_param_specs(config, rollout_tp, j)]
        receiver = PoolReceiver(plan, specs, bridge, verify=verify)
        staging, live = (torch.zeros(receiver.numel, dtype=dtype) for _ in range(2))
        reference = reference_rollout_shard(config, hf, rollout_tp, j, dtype)

        def views(flat):
            return {n: flat[o:o + math.prod(s)].view(s) for (n, s), o in zip(specs, receiver.offsets.values(),
                                                                               strict=True)}

        def check(flat) -> bool:
            got = views(flat)
            return all(torch.equal(got[n], t) for n, t in reference.items())
    else:
        source, offsets = training_shard(config, placement.training, rank, hf, dtype)
        sender = PoolSender(plan, source, offsets, bridge, verify=verify, delta=delta_steps > 0)
    if not delta_steps:
        hf = None  # only the delta steps need the fp32 weights again

    def sync(dense: bool = True):
        if sender is not None:
            return sender.send(None if offsets is not None else source, dense=dense)
        return receiver.receive(staging, live)

    stats = sync()
    result.update(peak_extra_bytes=stats.peak_extra_bytes, first_seconds=stats.seconds)
    if role == ROLLOUT:
        result["verified"] = check(staging)
    result["seconds"] = _timed(sync, repeats)
    if role == ROLLOUT:
        result["verified"] = result["verified"] and check(staging)
        live.copy_(staging)  # the swap at the step boundary: what the engine now reads
    if with_naive:
        group = dist.new_group([0] + list(range(placement.n_training, placement.world_size)))
        naive_flat = torch.zeros(receiver.numel, dtype=dtype) if role == ROLLOUT else None
        naive_params = views(naive_flat) if role == ROLLOUT else None
        result["naive_seconds"] = _timed(lambda: naive_sync(config, placement.training, placement, rank, bridge,
                                                            source, offsets, naive_params, group, dtype), repeats)
        if role == ROLLOUT:
            result["naive_verified"] = check(naive_flat)
    if role == ROLLOUT:
        memcpy_src = torch.empty_like(staging).normal_()
        result["memcpy_seconds"] = _timed(lambda: staging.copy_(memcpy_src), repeats)
        staging.copy_(live)
    else:
        result["memcpy_seconds"] = _timed(lambda: None, repeats)
    if delta_steps:
        adam_steps(hf, delta_steps, lr, seed)
        if role == ROLLOUT:
            reference = reference_rollout_shard(config, hf, rollout_tp, j, dtype)
        else:
            fresh, _ = training_shard(config, placement.training, rank, hf, dtype)
            _refill(source, fresh)
        dist.barrier()  # every rank has its new weights (or reference): time the sync alone
        start = time.perf_counter()
        stats = sync(dense=False)
        result.update(delta_seconds=time.perf_counter() - start, delta_bytes=stats.bytes,
                      dense_bytes=stats.dense_bytes)
        if role == ROLLOUT:
            result["delta_verified"] = check(staging)
        else:
            result["delta_cache_bytes"] = sum(t.numel() * t.element_size() for t in sender._previous.values())
    return result


def report(ranks: list[dict], placement, args, config: ModelConfig) -> dict:
    """The bench's JSON from every rank's result."""
    from verl.hybrid_engine.layouts import hf_tensor_shapes

    training = [r for r in ranks if r["role"] == "training"]
    rollout = [r for r in ranks if r["role"] == "rollout"]
    formula = ranks[0]["formula"]
    received = [r["bytes"] for r in rollout]
    sent = [r["bytes"] for r in training]
    seconds = max(r["seconds"] for r in ranks)
    element = DTYPES[args.dtype].itemsize
    full_model = sum(math.prod(s) for s in hf_tensor_shapes(config).values()) * element
    out = {
        "placement": "separate", "train": args.train, "rollout": {"tp": placement.rollout_tp},
        "rollout_replicas": placement.replicas, "nproc": placement.world_size, "dtype": args.dtype,
        "feed": placement.feed_rule,
        "verified": all(r["verified"] for r in rollout),
        "bytes_received_per_rank": received,
        "bytes_sent_per_rank": sent,
        "bytes_forwarded_per_rank": [r["forwarded"] for r in rollout],  # to the next replica (R*t_g > N_t)
        "bytes_formula": formula,
        "bytes_received_equals_formula": received == formula["received_per_rank"]
        and [r["forwarded"] for r in rollout] == formula["forwarded_per_rank"],
        "bytes_sent_max_over_mean": max(sent) / (sum(sent) / len(sent)) if sum(sent) else 1.0,
        "seconds": seconds,
        "memcpy_seconds": max(r["memcpy_seconds"] for r in rollout),
        "peak_extra_bytes_training": max(r["peak_extra_bytes"] for r in training),
        "bucket_bytes": args.bucket_bytes,
        "checksums": not args.no_verify,
        # What a rollout rank receives the peers' way (every full tensor) over what it receives here.
        "byte_ratio": full_model / max(received),
    }
    if not args.no_naive:
        out["naive_seconds"] = max(r["naive_seconds"] for r in ranks)
        out["naive_verified"] = all(r["naive_verified"] for r in rollout)
        out["naive_over_seconds"] = out["naive_seconds"] / seconds
    if args.delta_after_steps:
        delta = sum(r["delta_bytes"] for r in training)
        out.update(delta_after_steps=args.delta_after_steps, lr=args.lr,
                   delta_fraction=delta / max(1, sum(r["dense_bytes"] for r in training)),
                   delta_verified=all(r["delta_verified"] for r in rollout),
                   delta_seconds=max(r["delta_seconds"] for r in ranks),
                   delta_cache_bytes_training=max(r["delta_cache_bytes"] for r in training))
    return out
