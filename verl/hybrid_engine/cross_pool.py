"""The reshard across pools: the training ranks send each rank of a standalone rollout pool exactly its shard.

Placement (:class:`PoolPlacement`): the job's ranks are the training pool ``[0, N_t)`` (a Megatron
(p, t, d) or FSDP layout, numbered as :mod:`groups` numbers it) followed by the rollout pool
``[N_t, N_t + R*t_g)``: R replicas of rollout TP size t_g, replica k's tp rank j on ``N_t + k*t_g + j``.
These are ranks of the *bridge* group that spans both pools (:mod:`verl.launcher.pools`).

The plan is the colocated planner's intersection of layouts (:func:`planner._sources`) with no local
copies: every element of rollout shard j that is not vocab padding is one transfer from one training
rank that holds it, to each of the R ranks with tp rank j. The sender of each rectangle is chosen to
balance the training ranks: the rectangle's rows are split evenly over every training rank that holds
them (all DP replicas of every (stage, tp rank) that stores it), least-loaded first. So

* rollout rank (k, j) receives ``P_j`` elements, its shard's payload (``M / t_g`` plus what t_g ranks
  replicate: norms, and KV heads when t_g > num_kv_heads) -- once, and nothing else;
* training rank i sends ``R * sum_j P_j / N_t`` elements (``sum_j P_j / N_t`` when replicas forward), up to
  the rounding of row splits.

How replicas beyond the first are fed is chosen by which takes less time. With one link per rank of
bandwidth B, feeding every replica from the training ranks takes ``max(R*M'/N_t, P_j) / B`` (each training
rank sends its share of R copies), forwarding inside the rollout pool (replica 0 from the training ranks,
replica k from replica k-1, bucket by bucket) ``~ max(M'/N_t, P_j) / B`` plus one bucket per hop. They differ
only when ``R * t_g > N_t`` (more rollout ranks than training ranks: the training ranks' uplinks bound direct
feeding), so the plan forwards exactly then (:attr:`PoolPlacement.forward`); a forwarded bucket travels whole
(one message per hop, dense) with its checksum.

Traffic is cut into buckets of at most ``bucket_bytes`` sent and at most ``bucket_bytes`` received per
rank (first fit, as the colocated all-to-all buckets), so scratch is bounded: two buckets in flight.

Pure Python, deterministic, no tensors: every rank derives the same global assignment (cached).
"""

from __future__ import annotations

import dataclasses
import functools

from verl.errors import InputError
from verl.hybrid_engine.layouts import AnyTrainingLayout, LayoutError, describe_training
from verl.hybrid_engine.planner import (
    DEFAULT_BUCKET_BYTES,
    Segment,
    _a2a_buckets,
    _from,
    _holder_ranks,
    _merge,
    _Route,
    _segment,
    _sources,
    _tables,
    _zero_fill,
)
from verl.hybrid_engine.rollout_layout import RolloutLayout, check_rollout_tp
from verl.models.config import ModelConfig
from verl.utils.torch_dtypes import ELEMENT_SIZES

TRAINING, ROLLOUT = "training", "rollout"


@dataclasses.dataclass(frozen=True)
class PoolPlacement:
    """Where both pools sit on the bridge group's ranks."""

    training: AnyTrainingLayout
    rollout_tp: int
    replicas: int

    def __post_init__(self):
        for key in ("rollout_tp", "replicas"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"rollout pool {key}: expected a positive integer, found {value!r}")

    @property
    def n_training(self) -> int:
        return self.training.world_size

    @property
    def n_rollout(self) -> int:
        return self.rollout_tp * self.replicas

    @property
    def world_size(self) -> int:
        return self.n_training + self.n_rollout

    def rollout_rank(self, replica: int, tp_rank: int) -> int:
        """The bridge rank of rollout replica ``replica``'s tp rank ``tp_rank``."""
        return self.n_training + replica * self.rollout_tp + tp_rank

    def role(self, rank: int) -> tuple[str, int, int]:
        """(TRAINING, rank, 0) or (ROLLOUT, replica, tp rank) of a bridge rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"bridge rank: expected 0 <= rank < {self.world_size}, found {rank}")
        if rank < self.n_training:
            return TRAINING, rank, 0
        k, j = divmod(rank - self.n_training, self.rollout_tp)
        return ROLLOUT, k, j

    @property
    def forward(self) -> bool:
        """Replicas beyond the first get their buckets from the previous replica (see the module docstring)."""
        return self.replicas > 1 and self.n_rollout > self.n_training

    @property
    def feed_rule(self) -> str:
        """Which way of feeding replicas beyond the first costs less, by the model in the module docstring."""
        if not self.forward:
            return (f"R*t_g={self.n_rollout} <= N_t={self.n_training}: every replica is fed by the training ranks "
                    f"(no slower than forwarding: the receivers' links bound both)")
        return (f"R*t_g={self.n_rollout} > N_t={self.n_training}: replica 0 is fed by the training ranks, replica k "
                f"by replica k-1 (the training ranks' uplinks would bound direct feeding: R*M'/N_t per rank)")

    def __str__(self) -> str:
        return (f"training {describe_training(self.training)} on ranks [0, {self.n_training}) -> rollout t_g="
                f"{self.rollout_tp} x {self.replicas} replicas on ranks [{self.n_training}, {self.world_size})")


@dataclasses.dataclass(frozen=True)
class Span:
    """One peer's part of a bucket buffer: ``numel`` elements at ``offset``."""

    peer: int
    offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class PoolBucket:
    """This rank's part of one bucket: training ranks pack and send, rollout ranks receive and unpack."""

    index: int
    numel: int                   # this rank's buffer (send or receive) in elements
    spans: tuple[Span, ...]      # per peer, in peer order
    program: tuple[Segment, ...]  # pack (training params -> buffer) or unpack (buffer -> rollout params)
    forward_to: int | None = None  # ROLLOUT with forwarding: the next replica's rank, sent the whole bucket


@dataclasses.dataclass(frozen=True)
class CrossPoolPlan:
    rank: int                 # bridge rank
    role: str                 # TRAINING or ROLLOUT
    placement: PoolPlacement
    replica: int              # ROLLOUT only (else 0)
    rollout_tp_rank: int      # ROLLOUT only (else 0)
    dtype: str
    bucket_bytes: int
    num_buckets: int          # global: every rank walks the same bucket indices
    buckets: tuple[PoolBucket, ...]  # only the buckets this rank takes part in
    zero_fill: tuple[tuple[str, int, int], ...]  # ROLLOUT: (param, offset, numel) of vocab padding
    payload_elems: tuple[int, ...]   # P_j per rollout tp rank
    sent_elems: tuple[int, ...]      # per training rank, over all buckets
    received_elems: tuple[int, ...]  # per rollout rank (bridge rank - N_t)

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZES[self.dtype]

    @property
    def bytes(self) -> int:
        """What this rank sends (training) or receives (rollout) per sync."""
        return sum(b.numel for b in self.buckets) * self.element_size

    @property
    def forwarded_bytes(self) -> int:
        """What a rollout rank passes on to the next replica per sync (forwarding only)."""
        return sum(b.numel for b in self.buckets if b.forward_to is not None) * self.element_size

    @property
    def peak_extra_bytes(self) -> int:
        """Two buckets in flight at most (the executor's double buffering)."""
        sizes = sorted((b.numel for b in self.buckets), reverse=True)[:2]
        return sum(sizes) * self.element_size

    def formula(self) -> dict[str, object]:
        """The bytes every rank should move, from the layouts alone (what the bench prints and checks)."""
        p, size = self.placement, self.element_size
        shard = [self.payload_elems[j] * size for j in range(p.rollout_tp)]
        copies = 1 if p.forward else p.replicas
        return {
            "text": "received by rollout rank (k, j) = P_j (its shard's payload: M/t_g + replicated norms/KV heads); "
                    "sent by each training rank = R * sum_j P_j / N_t (rows split evenly over the holders), or "
                    "sum_j P_j / N_t when replicas forward (R*t_g > N_t), replica k < R-1 then sending P_j on",
            "received_per_rank": [shard[j] for _ in range(p.replicas) for j in range(p.rollout_tp)],
            "sent_per_rank_mean": copies * sum(shard) / p.n_training,
            "forwarded_per_rank": [shard[j] if p.forward and k < p.replicas - 1 else 0
                                   for k in range(p.replicas) for j in range(p.rollout_tp)],
            "model_bytes": sum(shard),
        }

    def summary(self) -> str:
        f = self.formula()
        return "\n".join([
            f"CrossPoolPlan bridge rank {self.rank} ({self.role}): {self.placement}, {self.dtype}",
            f"  {self.placement.feed_rule}",
            f"  buckets: {len(self.buckets)} of {self.num_buckets}, bucket_bytes={self.bucket_bytes}, "
            f"this rank moves {self.bytes} bytes, peak extra {self.peak_extra_bytes}",
            f"  formula: {f['text']}; M'={f['model_bytes']}, sent per training rank {f['sent_per_rank_mean']:.0f}",
        ])


@dataclasses.dataclass(frozen=True)
class _GlobalPool:
    buckets: list[list[_Route]]   # bucket -> routes (src training rank, dst bridge rank, transfer)
    payload: list[int]
    zero_fill: dict[int, list[tuple[str, int, int]]]


@functools.lru_cache(maxsize=16)
def _global_pool_plan(config: ModelConfig, placement: PoolPlacement, bucket_elems: int) -> _GlobalPool:
    training, tg = placement.training, placement.rollout_tp
    # LoRA's adapter layout (lora_sync) brings its own rollout side.
    tables = _tables(config, training, training.rollout_layout(tg) if hasattr(training, "rollout_layout")
                     else RolloutLayout(tg))
    load = [0] * placement.n_training
    routes: list[_Route] = []
    payload = [0] * tg
    for k in range(1 if placement.forward else placement.replicas):  # forwarding: replica 0 only
        for j in range(tg):
            dst = placement.rollout_rank(k, j)
            for template, found in _sources(tables, j):
                if k == 0:
                    payload[j] += template.numel
                holders = sorted({(r, h) for h in found for r in _holder_ranks(training, h)},
                                 key=lambda item: (load[item[0]], item[0]))
                n = min(len(holders), template.rows)
                for i, (src, holder) in enumerate(holders[:n]):
                    row0, row1 = template.rows * i // n, template.rows * (i + 1) // n
                    tr = _from(template, holder).sub(row0, row1 - row0)
                    routes.append(_Route(src, dst, tr))
                    load[src] += tr.numel
    return _GlobalPool(_a2a_buckets(routes, max(1, bucket_elems)), payload,
                       {j: _zero_fill(tables, j) for j in range(tg)})


def plan_cross_pool(config: ModelConfig, placement: PoolPlacement, rank: int,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: str = "bfloat16") -> CrossPoolPlan:
    """The plan of bridge ``rank`` for sending the actor from the training pool to the rollout pool."""
    if dtype not in ELEMENT_SIZES:
        raise InputError(f"dtype: expected one of {sorted(ELEMENT_SIZES)}, found {dtype!r}")
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InputError(f"bucket_bytes: expected a positive integer, found {bucket_bytes!r}")
    placement.training.check(config)
    check_rollout_tp(config, placement.rollout_tp)
    role, a, b = placement.role(rank)
    g = _global_pool_plan(config, placement, bucket_bytes // ELEMENT_SIZES[dtype])
    sent = [0] * placement.n_training
    received = [0] * placement.n_rollout
    mine: list[PoolBucket] = []
    forwarded = role == ROLLOUT and placement.forward
    # With forwarding, replica k's buckets are replica 0's (same shard, same order), whole from replica k-1.
    me = placement.rollout_rank(0, b) if forwarded else rank
    for index, routes in enumerate(g.buckets):
        for r in routes:
            sent[r.src] += r.transfer.numel
            received[r.dst - placement.n_training] += r.transfer.numel
        if role == TRAINING:
            own = sorted((r for r in routes if r.src == rank), key=lambda r: r.dst)  # stable: plan order kept
            peer_of = lambda r: r.dst  # noqa: E731
        else:
            own = sorted((r for r in routes if r.dst == me), key=lambda r: r.src)
            peer_of = lambda r: r.src  # noqa: E731
        if not own:
            continue
        spans, segments, offset = [], [], 0
        for r in own:
            if not spans or spans[-1][0] != peer_of(r):
                spans.append([peer_of(r), offset, 0])
            spans[-1][2] += r.transfer.numel
            segments.append(_segment(r.transfer, None, offset) if role == TRAINING
                            else _segment(r.transfer, offset, None))
            offset += r.transfer.numel
        if forwarded:
            spans = [[placement.rollout_rank(a - 1, b), 0, offset]] if a > 0 else spans
            forward_to = placement.rollout_rank(a + 1, b) if a + 1 < placement.replicas else None
        else:
            forward_to = None
        mine.append(PoolBucket(index, offset, tuple(Span(*s) for s in spans), _merge(segments), forward_to))
    if placement.forward:  # replicas beyond the first receive what replica 0 does, from their predecessor
        for k in range(1, placement.replicas):
            for j in range(placement.rollout_tp):
                received[k * placement.rollout_tp + j] = received[j]
    return CrossPoolPlan(
        rank=rank, role=role, placement=placement, replica=a if role == ROLLOUT else 0,
        rollout_tp_rank=b if role == ROLLOUT else 0, dtype=dtype, bucket_bytes=bucket_bytes,
        num_buckets=len(g.buckets), buckets=tuple(mine),
        zero_fill=tuple(g.zero_fill[b]) if role == ROLLOUT else (),
        payload_elems=tuple(g.payload), sent_elems=tuple(sent), received_elems=tuple(received))
