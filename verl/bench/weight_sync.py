"""`verl bench reshard --placement separate`: the cross-pool weight sync against the peers' way, verified.

    verl bench reshard --model CONFIG.json --train tp=2,pp=1,dp=1 --rollout tp=1 --rollout-replicas 2 \\
        --placement separate --nproc 4 --json F [--delta-after-steps K]

``--nproc`` counts both pools: the training ranks (tp*pp*dp or fsdp*replicate) come first, then
``rollout tp x replicas`` rollout ranks. The weights are the same seeded HF weights on every rank (std 0.02, as
HF initialises; :class:`SeededWeights`), but no rank holds them whole: each value is made in a fixed row block of
its tensor, so a rank makes only the blocks it cuts, one at a time. Training ranks take their shard (Megatron:
the HF -> Megatron converter's rules; FSDP: the row chunks ``fully_shard`` keeps), rollout ranks a staging buffer
and check it, one parameter at a time, against the reference cut straight from the weights. Reported:

* ``verified``: every rollout rank's staging buffer equals its reference bit for bit after the sync;
* ``bytes_received_per_rank`` (rollout ranks), ``bytes_sent_per_rank`` (training ranks) and, when replicas
  forward (R*t_g > N_t), ``bytes_forwarded_per_rank``, against ``bytes_formula`` (:meth:`CrossPoolPlan.formula`);
* ``seconds`` (best of ``--repeats``) and two baselines in the same run, each verified like the sync:
  ``bucketed_seconds``, the peers' way (verl's checkpoint engine, slime's broadcast): full tensors gathered on
  training rank 0 into buckets of ``--bucket-bytes``, each bucket broadcast asynchronously to every rollout rank
  while the next one is gathered (two in flight), every rollout rank narrowing its shards out of it;
  ``naive_seconds``, the same unbucketed (one blocking broadcast a tensor); ``memcpy_seconds`` of one shard;
* ``peak_extra_bytes_training``: the sender's scratch (two buckets), the delta cache reported apart;
* with ``--delta-after-steps K``: K Adam steps (``--lr``, verl's default 1e-6; random gradients, each block's
  own, the same on every rank) move the fp32 master weights, the training shards are rebuilt in place, and a delta
  sync follows:
  ``delta_fraction`` (bytes sent / dense bytes) and ``delta_verified`` (bit-exact against the new reference).
"""

from __future__ import annotations

import hashlib
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


BLOCK_ELEMENTS = 1 << 22  # fp32 values made at once: 16 MiB, and 3x that for Adam's state and gradient


def _adam(tensors: list[torch.Tensor], steps: int, lr: float, gen: torch.Generator) -> list[torch.Tensor]:
    """``tensors`` after ``steps`` Adam updates with gradients drawn from ``gen`` (per step, per tensor, in order)."""
    params = [torch.nn.Parameter(t) for t in tensors]
    optimizer = torch.optim.Adam(params, lr=lr, foreach=False)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return [p.detach() for p in params]


class SeededWeights:
    """The bench's HF weights (std ``INIT_STD``) after ``steps`` Adam updates at ``lr`` with random gradients, made
    block by block: block b of a tensor (viewed as rows x cols; ``block_elements // cols`` rows a block) is drawn
    from a generator seeded by (seed, tensor name, b), its values then its gradients, and stepped on its own. A
    value depends on its block alone, and a block is computed the same way whatever slice asks for it: every rank
    gets the same bits for the same element while making only the blocks it cuts, one at a time."""

    def __init__(self, config: ModelConfig, seed: int, steps: int = 0, lr: float = 1e-6,
                 block_elements: int = BLOCK_ELEMENTS):
        from verl.hybrid_engine.layouts import hf_tensor_shapes

        self.shapes = hf_tensor_shapes(config)
        self.seed, self.steps, self.lr, self.block_elements = seed, steps, lr, block_elements

    def _block(self, name: str, b: int, per: int, rows: int, cols: int) -> torch.Tensor:
        digest = hashlib.blake2b(f"{self.seed}/{name}/{b}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)  # str hash() differs per process
        values = torch.randn(min(per, rows - b * per), cols, generator=gen).mul_(INIT_STD)
        return _adam([values], self.steps, self.lr, gen)[0] if self.steps else values

    def rows(self, name: str, row0: int, row1: int, col0: int, col1: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [row0, row1) x columns [col0, col1) of ``name`` viewed as a matrix, in ``dtype``."""
        from verl.hybrid_engine.layouts import as_matrix

        rows, cols = as_matrix(self.shapes[name])
        per = max(1, self.block_elements // cols)
        out = torch.empty(row1 - row0, col1 - col0, dtype=dtype)
        for b in range(row0 // per, -(-row1 // per)):
            lo, hi = max(row0, b * per), min(row1, (b + 1) * per)
            block = self._block(name, b, per, rows, cols)
            out[lo - row0:hi - row0].copy_(block[lo - b * per:hi - b * per, col0:col1])
        return out

    def full(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole HF tensor ``name`` in ``dtype``."""
        shape = self.shapes[name]
        return self.rows(name, 0, shape[0], 0, math.prod(shape[1:]), dtype).view(shape)

    def source(self, dtype: torch.dtype):
        """name -> what ``layouts.fill_local`` indexes like the full tensor, making only the rows indexed."""
        return lambda name: _Slicer(self, name, dtype)


class _Slicer:
    """``full[r0:r1]`` / ``full[r0:r1, c0:c1]`` of a :class:`SeededWeights` tensor without making the rest."""

    def __init__(self, weights: SeededWeights, name: str, dtype: torch.dtype):
        self.weights, self.name, self.dtype = weights, name, dtype

    def __getitem__(self, index):
        from verl.hybrid_engine.layouts import as_matrix

        shape = self.weights.shapes[self.name]
        rows, cols = as_matrix(shape)
        index = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(i, slice) for i in index) or len(index) > min(2, len(shape)):
            raise TypeError(f"{self.name}: expected a row slice or a (row, column) slice pair, found {index!r}")
        (row0, row1, row_step), (col0, col1, col_step) = (index[0].indices(rows),
                                                          index[1].indices(cols) if len(index) == 2 else (0, cols, 1))
        if row_step != 1 or col_step != 1:
            raise TypeError(f"{self.name}: expected contiguous slices, found {index!r}")
        out = self.weights.rows(self.name, row0, max(row0, row1), col0, max(col0, col1), self.dtype)
        return out.view(-1) if len(shape) == 1 else out


def _getters(hf, dtype: torch.dtype):
    """(name -> full tensor, name -> what fill_local indexes) in ``dtype``, from :class:`SeededWeights` or a dict of
    full HF tensors."""
    if isinstance(hf, SeededWeights):
        return (lambda n: hf.full(n, dtype)), hf.source(dtype)

    def get(n):
        return hf[n].to(dtype)

    return get, get


def training_shard(config: ModelConfig, training, rank: int, hf, dtype: torch.dtype, out=None):
    """(flat buffer, offsets) for a Megatron rank, or ({name: 1-D local chunk}, None) for an FSDP rank, from ``hf``
    (:class:`SeededWeights` or a dict of full HF tensors). ``out``: an earlier result's first element (the flat
    buffer or the chunks) to overwrite in place, as an optimizer step updates the tensors a sender is bound to."""
    from verl.hybrid_engine.layouts import FSDPLayout, fill_local, hf_tensor_shapes, local_shape

    get, source = _getters(hf, dtype)
    if isinstance(training, FSDPLayout):
        shapes = hf_tensor_shapes(config)
        _, _, s = training.coords(rank)
        chunks = {} if out is None else out
        for param in training.params(config):
            if out is None:
                chunks[param.name] = torch.empty(math.prod(local_shape(param, shapes, training.shard, s)), dtype=dtype)
            fill_local(param, shapes, training.shard, s, chunks[param.name], source)
        return chunks, None
    from verl.hybrid_engine.executor import flat_offsets
    from verl.hybrid_engine.layouts import training_param_specs
    from verl.models.mcore.weights import weight_rules

    # The converter's rules one parameter at a time, straight into the flat buffer: no second copy of the shard.
    stage, _, r = training.coords(rank)
    specs = training_param_specs(config, training.tp, training.pp, r, stage)
    offsets, numel = flat_offsets(specs)
    flat = torch.empty(numel, dtype=dtype) if out is None else out
    for rule, (name, shape) in zip(weight_rules(config, training.pp, stage), specs, strict=True):
        local = rule.layout.shard([get(n) for n in rule.hf], config, training.tp, r)
        if rule.mcore != name or tuple(local.shape) != tuple(shape):
            raise RuntimeError(f"training layout: expected {name} {tuple(shape)} (the layout's specs), found "
                               f"{rule.mcore} {tuple(local.shape)} from the converter")
        flat[offsets[name]:offsets[name] + local.numel()].view(shape).copy_(local)
    return flat, offsets


def adam_steps(hf: dict[str, torch.Tensor], steps: int, lr: float, seed: int) -> None:
    """``steps`` Adam updates of the full fp32 weights ``hf`` with random gradients (the same on every rank): the
    size of change an RL step makes at learning rate ``lr`` (Adam's update is ~lr per element whatever the
    gradient)."""
    new = _adam(list(hf.values()), steps, lr, torch.Generator().manual_seed(seed + 1))
    for name, t in zip(list(hf), new, strict=True):
        hf[name] = t


def _gather_pieces(tables, name: str, training, rank: int, bridge, source, offsets, full: torch.Tensor | None,
                   dtype: torch.dtype) -> list:
    """HF tensor ``name`` assembled into ``full`` on training rank 0 from the pieces DP replica 0 holds (one per
    distinct rectangle), point to point over the bridge; returns the sends still in flight (a holder's)."""
    seen, works = set(), []
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
                block = block.contiguous()
                works.append((bridge.isend(block, 0, 3), block))
        elif rank == 0:
            recv = torch.empty(piece.rows, piece.cols, dtype=dtype)
            bridge.irecv(recv, holder, 3).wait()
            full[piece.row:piece.row + piece.rows, piece.col:piece.col + piece.cols].copy_(recv)
    return works


def naive_sync(config: ModelConfig, training, placement, rank: int, bridge, source, offsets,
               rollout_params: dict[str, torch.Tensor] | None, broadcast_group, dtype: torch.dtype) -> None:
    """The unbucketed peers' way: each full HF tensor gathered on training rank 0, broadcast to every rollout rank
    (one blocking broadcast a tensor), narrowed."""
    import torch.distributed as dist

    from verl.bench.reshard_reference import copy_into_rollout, rollout_targets
    from verl.hybrid_engine.layouts import as_matrix, hf_tensor_shapes
    from verl.hybrid_engine.planner import _tables
    from verl.hybrid_engine.rollout_layout import RolloutLayout

    tables = _tables(config, training, RolloutLayout(1))
    role, _, j = placement.role(rank)
    targets = rollout_targets(config, placement.rollout_tp, j) if role == "rollout" else None
    for name, shape in hf_tensor_shapes(config).items():
        rows, cols = as_matrix(shape)
        full = torch.empty(rows, cols, dtype=dtype) if rank == 0 or role == "rollout" else None
        for work, _ in _gather_pieces(tables, name, training, rank, bridge, source, offsets, full, dtype):
            work.wait()
        if rank == 0 or role == "rollout":
            dist.broadcast(full, src=0, group=broadcast_group)
        if role == "rollout" and name in targets:  # a rank may hold only vocab padding of a small table
            copy_into_rollout(name, full.view(shape), targets, rollout_params)


def buckets_of(shapes: dict[str, tuple[int, ...]], bucket_bytes: int, element: int) -> list[list[str]]:
    """HF tensor names in order, packed into buckets of at most ``bucket_bytes`` (a larger tensor: a bucket of its
    own)."""
    out: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * element
        if out[-1] and used + size > bucket_bytes:
            out.append([])
            used = 0
        out[-1].append(name)
        used += size
    return out


def bucketed_sync(config: ModelConfig, training, placement, rank: int, bridge, source, offsets,
                  rollout_params: dict[str, torch.Tensor] | None, broadcast_group, dtype: torch.dtype,
                  bucket_bytes: int) -> None:
    """The peers' bucketed, pipelined way (verl's checkpoint engine, slime's weight broadcast): training rank 0
    gathers full HF tensors into a bucket of ``bucket_bytes``, broadcasts it asynchronously to every rollout rank
    and gathers the next bucket into a second buffer meanwhile (two in flight); each rollout rank narrows its
    shards out of a bucket once it has arrived, while the next one is on its way."""
    import torch.distributed as dist

    from verl.bench.reshard_reference import copy_into_rollout, rollout_targets
    from verl.hybrid_engine.layouts import as_matrix, hf_tensor_shapes
    from verl.hybrid_engine.planner import _tables
    from verl.hybrid_engine.rollout_layout import RolloutLayout

    tables = _tables(config, training, RolloutLayout(1))
    role, _, j = placement.role(rank)
    targets = rollout_targets(config, placement.rollout_tp, j) if role == "rollout" else None
    shapes = hf_tensor_shapes(config)
    buckets = buckets_of(shapes, bucket_bytes, dtype.itemsize)
    holds_bucket = rank == 0 or role == "rollout"
    in_flight: list = []  # (broadcast work, bucket buffer, its names): at most two

    def finish(work, buffer, names):
        work.wait()
        if role != "rollout":
            return
        offset = 0
        for name in names:
            numel = math.prod(shapes[name])
            if name in targets:  # a rank may hold only vocab padding of a small table
                copy_into_rollout(name, buffer[offset:offset + numel].view(shapes[name]), targets, rollout_params)
            offset += numel

    for names in buckets:
        numel = sum(math.prod(shapes[n]) for n in names)
        if len(in_flight) == 2:
            finish(*in_flight.pop(0))
        buffer = torch.empty(numel, dtype=dtype) if holds_bucket else None
        offset, sends = 0, []
        for name in names:
            rows, cols = as_matrix(shapes[name])
            full = buffer[offset:offset + rows * cols].view(rows, cols) if rank == 0 else None
            sends += _gather_pieces(tables, name, training, rank, bridge, source, offsets, full, dtype)
            offset += rows * cols
        for work, _ in sends:
            work.wait()
        if holds_bucket:
            in_flight.append((dist.broadcast(buffer, src=0, group=broadcast_group, async_op=True), buffer, names))
    for pending in in_flight:
        finish(*pending)


def separate_rank(rank: int, nproc: int, cfg: dict, train: dict, rollout_tp: int, replicas: int, dtype_name: str,
                  bucket_bytes: int, seed: int, repeats: int, with_naive: bool, delta_steps: int = 0,
                  lr: float = 1e-6, verify: bool = True) -> dict:
    """One rank of the separate-placement bench (and of the tests' matrix): sync, verify, time."""
    import torch.distributed as dist

    from verl.bench.reshard_reference import reference_rollout_params, timed
    from verl.hybrid_engine.cross_pool import ROLLOUT, PoolPlacement, plan_cross_pool
    from verl.hybrid_engine.rollout_layout import rollout_param_specs
    from verl.hybrid_engine.weight_sync import PoolReceiver, PoolSender
    from verl.launcher.pools import Bridge

    config = ModelConfig.from_fields(cfg)
    placement = PoolPlacement(_layout(train), rollout_tp, replicas)
    dtype = DTYPES[dtype_name]
    bridge = Bridge(dist.distributed_c10d._get_default_group(), rank, nproc)
    weights = SeededWeights(config, seed)
    plan = plan_cross_pool(config, placement, rank, bucket_bytes, dtype_name)
    role, replica, j = placement.role(rank)
    result = {"rank": rank, "role": role, "replica": replica, "tp_rank": j, "bytes": plan.bytes,
              "forwarded": plan.forwarded_bytes,
              "summary": plan.summary() if rank in (0, placement.n_training) else None,
              "formula": plan.formula() if rank == 0 else None}
    sender = receiver = staging = live = source = offsets = None
    if role == ROLLOUT:
        specs = [(s.name, s.shape) for s in rollout_param_specs(config, rollout_tp, j)]
        receiver = PoolReceiver(plan, specs, bridge, verify=verify)
        staging, live = (torch.zeros(receiver.numel, dtype=dtype) for _ in range(2))

        def views(flat):
            return {n: flat[o:o + math.prod(s)].view(s) for (n, s), o in zip(specs, receiver.offsets.values(),
                                                                               strict=True)}

        def check(flat, expected: SeededWeights) -> bool:
            """``flat`` against the reference cut from ``expected``, made one parameter at a time."""
            got = views(flat)
            return all(torch.equal(got[n], t)
                       for n, t in reference_rollout_params(config, expected.source(dtype), rollout_tp, j, dtype))
    else:
        source, offsets = training_shard(config, placement.training, rank, weights, dtype)
        sender = PoolSender(plan, source, offsets, bridge, verify=verify, delta=delta_steps > 0)

    def sync(dense: bool = True):
        if sender is not None:
            return sender.send(None if offsets is not None else source, dense=dense)
        return receiver.receive(staging, live)

    stats = sync()
    result.update(peak_extra_bytes=stats.peak_extra_bytes, first_seconds=stats.seconds)
    if role == ROLLOUT:
        result["verified"] = check(staging, weights)
        # The swap at the step boundary (what the engine now reads; a dense receive does not read it): from here
        # on ``live`` is the verified shard, what every later dense sync must reproduce.
        live.copy_(staging)
    result["seconds"] = timed(sync, repeats)
    if role == ROLLOUT:
        result["verified"] = result["verified"] and torch.equal(staging, live)
    if with_naive:
        group = dist.new_group([0] + list(range(placement.n_training, placement.world_size)))
        if role == ROLLOUT:
            staging.zero_()  # the naive path writes into the staging buffer: nothing left of the sync's
        naive_params = views(staging) if role == ROLLOUT else None
        result["naive_seconds"] = timed(lambda: naive_sync(config, placement.training, placement, rank, bridge,
                                                            source, offsets, naive_params, group, dtype), repeats)
        if role == ROLLOUT:
            result["naive_verified"] = torch.equal(staging, live)
            staging.zero_()
        result["bucketed_seconds"] = timed(lambda: bucketed_sync(config, placement.training, placement, rank, bridge,
                                                                  source, offsets, naive_params, group, dtype,
                                                                  bucket_bytes), repeats)
        if role == ROLLOUT:
            result["bucketed_verified"] = torch.equal(staging, live)
    if role == ROLLOUT:
        result["memcpy_seconds"] = timed(lambda: staging.copy_(live), repeats)  # and staging is live's again
    else:
        result["memcpy_seconds"] = timed(lambda: None, repeats)
    if delta_steps:
        moved = SeededWeights(config, seed, delta_steps, lr)
        if role != ROLLOUT:
            training_shard(config, placement.training, rank, moved, dtype, out=source)
        dist.barrier()  # every rank has its new weights: time the sync alone
        start = time.perf_counter()
        stats = sync(dense=False)
        result.update(delta_seconds=time.perf_counter() - start, delta_bytes=stats.bytes,
                      dense_bytes=stats.dense_bytes)
        if role == ROLLOUT:
            result["delta_verified"] = check(staging, moved)
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
        out["bucketed_seconds"] = max(r["bucketed_seconds"] for r in ranks)
        out["bucketed_verified"] = all(r["bucketed_verified"] for r in rollout)
        out["bucketed_over_seconds"] = out["bucketed_seconds"] / seconds
    if args.delta_after_steps:
        delta = sum(r["delta_bytes"] for r in training)
        out.update(delta_after_steps=args.delta_after_steps, lr=args.lr,
                   delta_fraction=delta / max(1, sum(r["dense_bytes"] for r in training)),
                   delta_verified=all(r["delta_verified"] for r in rollout),
                   delta_seconds=max(r["delta_seconds"] for r in ranks),
                   delta_cache_bytes_training=max(r["delta_cache_bytes"] for r in training))
    return out
