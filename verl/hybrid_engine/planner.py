"""The reshard planner: (config, training layout, rollout layout, rank) -> ReshardPlan. Pure Python.

Every destination element (a rollout rank's parameter element that is not vocab padding) gets
exactly one source: a training rank that holds it. The planner intersects the rollout layout's
pieces with the training layout's pieces (both from :mod:`layouts`), chooses sources, and cuts the
traffic into buckets of at most ``bucket_bytes``:

* HybridFlow case (t_g | t): each micro-DP group all-gathers; a rank packs the parts of its
  training shard the group needs straight into its slot of the bucket buffer (an in-place
  all-gather), and every member unpacks all slots into its rollout parameters. Elements held by
  several members (replicated norms, the tied embedding copy on the last stage) are split evenly
  between them so the slots stay balanced. Vocab rows that cross a padding boundary (Megatron pads
  the vocab to 128*t, SGLang to 64) have no holder in the group and move by a final all-to-all.
* General case: elements a rank already holds are copied locally first; the rest move by
  all-to-all buckets over the world group from the least-loaded holder.

The same two cases serve an :class:`FSDPLayout` (see :mod:`groups`): t_g = 1 all-gathers inside each
replicate's shard group, t_g > 1 is the general case; either way a rank receives exactly the elements
of its rollout shard it does not hold (``bytes_formula``).

Plans address parameters logically (parameter name + element offset); :mod:`executor` binds them to
flat buffers once. The plan of every rank is derived from one global assignment (cached), so all
ranks agree on every collective without talking.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

from verl.errors import InputError
from verl.hybrid_engine.groups import HYBRIDFLOW, ReshardGroups, derive_groups
from verl.hybrid_engine.layouts import (
    AnyTrainingLayout,
    ParamLayout,
    Piece,
    describe_training,
    hf_tensor_shapes,
    local_pieces,
)
from verl.hybrid_engine.rollout_layout import RolloutLayout
from verl.models.config import ModelConfig
from verl.utils.torch_dtypes import ELEMENT_SIZES

# Small buckets pipeline well (bucket k's transfer hides bucket k+-1's copies): on gloo, 4 MiB beat 16 and
# 64 MiB on every layout measured (verl bench reshard, 100M model) and keeps the extra memory at 2 x 4 MiB.
DEFAULT_BUCKET_BYTES = 4 << 20


ALL_GATHER = "all_gather"
ALL_TO_ALL = "all_to_all"


@dataclasses.dataclass(frozen=True)
class Segment:
    """One strided block copy addressed logically; a ``None`` param is the bucket's buffer."""

    src_param: str | None
    src_offset: int
    dst_param: str | None
    dst_offset: int
    rows: int
    row_elems: int
    src_stride: int
    dst_stride: int

    @property
    def numel(self) -> int:
        return self.rows * self.row_elems


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One collective and its copy programs (elements; see :class:`ReshardPlan` for the protocol)."""

    index: int
    collective: str                 # ALL_GATHER (over ``group``) or ALL_TO_ALL (over the world)
    group: tuple[int, ...]          # global ranks, in collective order
    recv_elems: int                 # receive buffer; ALL_GATHER: len(group) slots of slot_elems
    send_elems: int                 # ALL_TO_ALL send buffer; 0 for ALL_GATHER (packs into its slot)
    slot_elems: int                 # ALL_GATHER slot size (equal for all members)
    send_splits: tuple[int, ...]    # ALL_TO_ALL, per rank of ``group``
    recv_splits: tuple[int, ...]
    pack: tuple[Segment, ...]       # training params -> send buffer (ALL_GATHER: own slot of recv)
    unpack: tuple[Segment, ...]     # receive buffer -> rollout params
    payload_sent: int               # elements delivered to other ranks
    payload_received: int           # elements received from other ranks (padding excluded)

    @property
    def extra_elems(self) -> int:
        return self.recv_elems + self.send_elems


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    rank: int
    case: str
    reason: str
    training: AnyTrainingLayout
    rollout: RolloutLayout
    rollout_tp_rank: int
    rollout_tp_group: tuple[int, ...]
    micro_dp_group: tuple[int, ...]   # empty in the general case
    dtype: str
    bucket_bytes: int
    local: tuple[Segment, ...]        # training -> rollout copies on this rank, no communication
    buckets: tuple[Bucket, ...]
    zero_fill: tuple[tuple[str, int, int], ...]  # rollout (param, offset, numel): vocab padding
    model_bytes: int                  # M: payload bytes of one rollout TP group (all t_g shards)
    expert_bytes: int                 # X: the part of M that is expert parameters
    # What bytes_received is held to. Megatron HybridFlow: the mean over ranks, (p*t - t_g) / (t_g*p*t) * (M - X)
    # + (p*t*ep - t_g) / (t_g*p*t*ep) * X (etp = t; None for another etp).
    # FSDP: this rank's own bound, its rollout shard minus what it holds of it (t_g = 1, even: (S-1)/S * M).
    # None otherwise.
    bytes_formula: float | None

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZES[self.dtype]

    @property
    def bytes_sent(self) -> int:
        return sum(b.payload_sent for b in self.buckets) * self.element_size

    @property
    def bytes_received(self) -> int:
        return sum(b.payload_received for b in self.buckets) * self.element_size

    @property
    def padding_bytes(self) -> int:
        """Bytes the all-gathers carry beyond the payload (slots padded to equal size)."""
        pad = 0
        for b in self.buckets:
            if b.collective == ALL_GATHER:
                pad += b.recv_elems - b.slot_elems - b.payload_received
        return pad * self.element_size

    @property
    def peak_extra_bytes(self) -> int:
        return max((b.extra_elems for b in self.buckets), default=0) * self.element_size

    def summary(self) -> str:
        t = self.training
        gathers = sum(b.collective == ALL_GATHER for b in self.buckets)
        lines = [
            f"ReshardPlan rank {self.rank}: training {describe_training(t)} -> rollout "
            f"t_g={self.rollout.tp} (rollout tp rank {self.rollout_tp_rank}, group {list(self.rollout_tp_group)}), "
            f"{self.dtype}",
            f"  case: {self.case} - {self.reason}",
        ]
        if self.micro_dp_group:
            lines.append(f"  micro-DP group: {list(self.micro_dp_group)}")
        if self.case == HYBRIDFLOW and len(self.buckets) > gathers:
            lines.append("  plus all-to-all buckets: vocab rows that Megatron (pads to 128*t) and SGLang (pads to 64) "
                         "shard on different ranks")
        lines += [
            f"  buckets: {len(self.buckets)} ({gathers} all_gather, {len(self.buckets) - gathers} all_to_all), "
            f"bucket_bytes={self.bucket_bytes}, local copies: {len(self.local)} segments",
            f"  bytes sent: {self.bytes_sent}, received: {self.bytes_received}"
            + (f" (formula {self.bytes_formula:.0f} for M={self.model_bytes})"
               if self.bytes_formula is not None else "")
            + f", all-gather padding: {self.padding_bytes}",
            f"  peak extra bytes: {self.peak_extra_bytes}",
        ]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Global assignment
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Transfer:
    """rows x cols elements from a training param (row-major, ``src_stride`` cols) to a rollout param."""

    src_param: str
    src_row: int
    src_col: int
    src_stride: int
    dst_param: str
    dst_row: int
    dst_col: int
    dst_stride: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def sub(self, row: int, rows: int, col: int = 0, cols: int | None = None) -> _Transfer:
        cols = self.cols - col if cols is None else cols
        return dataclasses.replace(self, src_row=self.src_row + row, dst_row=self.dst_row + row, rows=rows,
                                   src_col=self.src_col + col, dst_col=self.dst_col + col, cols=cols)

    def take(self, space: int, empty: bool) -> tuple[_Transfer | None, list[_Transfer]]:
        """The head that fits in ``space`` elements and what remains (rows first, then within a row
        only when the destination chunk is ``empty`` and one row does not fit at all)."""
        if self.numel <= space:
            return self, []
        if self.cols <= space:
            k = space // self.cols
            return self.sub(0, k), [self.sub(k, self.rows - k)]
        if not empty:
            return None, [self]
        rest = [self.sub(0, 1, space)]
        if self.rows > 1:
            rest.append(self.sub(1, self.rows - 1))
        return self.sub(0, 1, 0, space), rest


class _Held(NamedTuple):
    """A training param (on pipeline ``stage``, tensor-parallel rank ``tp``) that stores ``piece``; an expert
    param's ``tp`` is its expert-tensor-parallel rank and ``ep`` its expert-parallel rank (None: dense)."""

    stage: int
    tp: int
    param: str
    stride: int  # the param's local columns
    piece: Piece
    ep: int | None = None


class _Holder(NamedTuple):
    """Where one destination rectangle starts inside a training param that holds it."""

    stage: int
    tp: int
    param: str
    row: int  # local row and column of the rectangle's first element
    col: int
    stride: int
    ep: int | None = None

    @property
    def place(self) -> tuple[int, int, int | None]:
        """(stage, tp rank, ep rank): the training shard, on every DP (dense) or expert-DP replica."""
        return self.stage, self.tp, self.ep


class _RolloutParam(NamedTuple):
    param: ParamLayout
    shape: tuple[int, int]  # local (rows, cols) on this rollout tp rank
    pieces: list[Piece]


class _Route(NamedTuple):
    """One all-to-all transfer: training rank ``src`` sends ``transfer`` to rank ``dst``."""

    src: int
    dst: int
    transfer: _Transfer


@dataclasses.dataclass(frozen=True)
class _Tables:
    shapes: dict[str, tuple[int, ...]]
    holders: dict[str, list[_Held]]            # logical tensor -> every training param piece storing part of it
    rollout_params: list[list[_RolloutParam]]  # per rollout tp rank


def _tables(config: ModelConfig, training: AnyTrainingLayout, rollout: RolloutLayout) -> _Tables:
    # A layout of other logical tensors than the model's HF weights (LoRA adapters: lora_sync) names them.
    shapes = training.tensor_shapes(config) if hasattr(training, "tensor_shapes") else hf_tensor_shapes(config)
    holders: dict[str, list[_Held]] = {}
    for stage in range(training.pp):
        for e in range(training.ep):
            for param in training.params(config, stage) if e == 0 else training.params(config, stage, e):
                if not param.expert and e > 0:
                    continue  # dense parameters: listed once, held on every EP rank
                tp_size = training.expert_tp if param.expert else training.tp
                for r in range(tp_size):
                    (_, cols), pieces = local_pieces(param, shapes, tp_size, r)
                    for piece in pieces:
                        holders.setdefault(piece.tensor, []).append(
                            _Held(stage, r, param.name, cols, piece, e if param.expert else None))
    rollout_params = []
    for j in range(rollout.tp):
        per_rank = []
        for param in rollout.params(config):
            shape, pieces = local_pieces(param, shapes, rollout.tp, j)
            per_rank.append(_RolloutParam(param, shape, pieces))
        rollout_params.append(per_rank)
    return _Tables(shapes, holders, rollout_params)


def _sources(tables: _Tables, j: int):
    """For rollout shard ``j``: (transfer template, holders) per destination rectangle, in order.

    A template's src fields are filled per holder (:func:`_from`).
    """
    for param, (_, dst_cols), pieces in tables.rollout_params[j]:
        for dst in pieces:
            by_rect: dict[tuple[int, int, int, int], list[_Holder]] = {}
            for stage, r, name, src_cols, src, ep in tables.holders[dst.tensor]:
                r0, r1 = max(dst.row, src.row), min(dst.row + dst.rows, src.row + src.rows)
                c0, c1 = max(dst.col, src.col), min(dst.col + dst.cols, src.col + src.cols)
                if r0 >= r1 or c0 >= c1:
                    continue
                by_rect.setdefault((r0, r1, c0, c1), []).append(
                    _Holder(stage, r, name, src.local_row + r0 - src.row, src.local_col + c0 - src.col, src_cols,
                            ep))
            for (r0, r1, c0, c1), found in sorted(by_rect.items()):
                template = _Transfer("", 0, 0, 0, param.name, dst.local_row + r0 - dst.row,
                                     dst.local_col + c0 - dst.col, dst_cols, r1 - r0, c1 - c0)
                yield template, found


def _from(template: _Transfer, holder: _Holder) -> _Transfer:
    return dataclasses.replace(template, src_param=holder.param, src_row=holder.row, src_col=holder.col,
                               src_stride=holder.stride)


def _holds(training: AnyTrainingLayout, rank: int, holder: _Holder) -> bool:
    """Whether training ``rank`` stores ``holder``'s param: dense ones by (stage, tp rank) on every DP
    replica, expert ones by (stage, ep rank, etp rank) on every expert-DP replica."""
    if holder.ep is None:
        stage, _, tp = training.coords(rank)
        return (stage, tp) == (holder.stage, holder.tp)
    return training.expert_coords(rank) == (holder.stage, holder.ep, holder.tp)


def _holder_ranks(training: AnyTrainingLayout, holder: _Holder) -> list[int]:
    if holder.ep is None:
        return [training.rank(holder.stage, d, holder.tp) for d in range(training.dp)]
    stage_ranks = range(holder.stage * training.tp * training.dp, (holder.stage + 1) * training.tp * training.dp)
    return [r for r in stage_ranks if _holds(training, r, holder)]


@dataclasses.dataclass
class _Global:
    groups: ReshardGroups
    local: dict[int, list[_Transfer]]
    gather_chunks: dict[tuple[int, ...], list[list[list[_Transfer]]]]  # group -> bucket -> member -> transfers
    a2a_buckets: list[list[_Route]]                                     # bucket -> its transfers
    zero_fill: dict[int, list[tuple[str, int, int]]]                    # rollout tp rank -> padding
    payload: list[int]                                                  # per rollout tp rank
    expert_payload: list[int]                                           # of which expert parameters
    tables: _Tables


def _zero_fill(tables: _Tables, j: int) -> list[tuple[str, int, int]]:
    out = []
    for param, (rows, cols), pieces in tables.rollout_params[j]:
        covered = sorted((p.local_row, p.local_row + p.rows) for p in pieces)
        cursor = 0
        for start, stop in covered + [(rows, rows)]:
            if start > cursor:
                out.append((param.name, cursor * cols, (start - cursor) * cols))
            cursor = max(cursor, stop)
    return out


def _chunk(transfers: Sequence[_Transfer], cap: int) -> list[list[_Transfer]]:
    """Cut an ordered transfer list into consecutive chunks of at most ``cap`` elements."""
    chunks: list[list[_Transfer]] = []
    current: list[_Transfer] = []
    fill = 0
    queue = list(reversed(transfers))
    while queue:
        tr = queue.pop()
        head, rest = tr.take(cap - fill, empty=fill == 0)
        queue.extend(reversed(rest))
        if head is None:
            chunks.append(current)
            current, fill = [], 0
            continue
        current.append(head)
        fill += head.numel
        if fill == cap:
            chunks.append(current)
            current, fill = [], 0
    if current:
        chunks.append(current)
    return chunks


def _split(tr: _Transfer, cap: int) -> list[_Transfer]:
    out, queue = [], [tr]
    while queue:
        head, rest = queue.pop().take(cap, empty=True)
        out.append(head)
        queue.extend(reversed(rest))
    return out


def _a2a_buckets(transfers: list[_Route], cap: int) -> list[list[_Route]]:
    """First-fit: a bucket holds at most ``cap`` send and ``cap`` receive elements per rank."""
    buckets: list[list[_Route]] = []
    sent: list[dict[int, int]] = []
    received: list[dict[int, int]] = []
    for src, dst, tr in transfers:
        for part in _split(tr, cap):
            for b in range(len(buckets) + 1):
                if b == len(buckets):
                    buckets.append([])
                    sent.append({})
                    received.append({})
                if sent[b].get(src, 0) + part.numel <= cap and received[b].get(dst, 0) + part.numel <= cap:
                    buckets[b].append(_Route(src, dst, part))
                    sent[b][src] = sent[b].get(src, 0) + part.numel
                    received[b][dst] = received[b].get(dst, 0) + part.numel
                    break
    return buckets


@functools.lru_cache(maxsize=16)
def _global_plan(config: ModelConfig, training: AnyTrainingLayout, rollout: RolloutLayout,
                 bucket_elems: int) -> _Global:
    groups = derive_groups(training, rollout.tp)
    tables = _tables(config, training, rollout)
    n = training.world_size
    load = [0] * n  # elements each rank sends, for least-loaded source choice
    local: dict[int, list[_Transfer]] = {rank: [] for rank in range(n)}
    a2a: list[_Route] = []
    gather_chunks = {}
    payload = [0] * rollout.tp

    def pick(candidates: list[int], prefer_dp: int) -> int:
        return min(candidates, key=lambda c: (load[c], training.coords(c)[1] != prefer_dp, c))

    if groups.case == HYBRIDFLOW:
        block = training.tp // rollout.tp
        for group in groups.micro_dp_groups:
            _, dp, r0 = training.coords(group[0])
            j = r0 // block
            contributions: dict[int, list[_Transfer]] = {m: [] for m in group}
            for template, found in _sources(tables, j):
                inside = [(h, m) for h in found for m in group if _holds(training, m, h)]
                if not inside:
                    # No member holds it (vocab rows across a padding boundary; experts of another EP rank):
                    # every member needs them, from a holder outside.
                    for m in group:
                        src = pick([r for h in found for r in _holder_ranks(training, h)], dp)
                        holder = next(h for h in found if _holds(training, src, h))
                        a2a.append(_Route(src, m, _from(template, holder)))
                        load[src] += template.numel
                    continue
                holding = {m: h for h, m in inside}
                if found[0].ep is not None and len(holding) == len(group) > 1:
                    # An expert every member holds whole (etp < t): each copies it, nobody receives it.
                    for m, h in holding.items():
                        local[m].append(_from(template, h))
                    continue
                inside.sort(key=lambda hm: (load[hm[1]], hm[1]))
                k = min(len(inside), template.rows)
                for i, (h, m) in enumerate(inside[:k]):
                    row0, row1 = template.rows * i // k, template.rows * (i + 1) // k
                    tr = _from(template, h).sub(row0, row1 - row0)
                    contributions[m].append(tr)
                    load[m] += tr.numel
            if len(group) == 1:  # t_g == t and p == 1: the rank already holds its whole rollout shard
                local[group[0]].extend(contributions[group[0]])
                continue
            cap = bucket_elems // len(group)
            if cap <= 0:
                raise InputError(f"bucket_bytes: expected room for one element per micro-DP rank ({len(group)}), "
                                 "found too few")
            per_member = [_chunk(contributions[m], cap) for m in group]
            count = max(len(c) for c in per_member)
            gather_chunks[group] = [[c[b] if b < len(c) else [] for c in per_member] for b in range(count)]
    else:
        for dst in range(n):
            _, dp, _ = training.coords(dst)
            j = groups.rollout_tp_rank[dst]
            for template, found in _sources(tables, j):
                own = [h for h in found if _holds(training, dst, h)]
                if own:
                    local[dst].append(_from(template, own[0]))
                    continue
                src = pick([r for h in found for r in _holder_ranks(training, h)], dp)
                holder = next(h for h in found if _holds(training, src, h))
                a2a.append(_Route(src, dst, _from(template, holder)))
                load[src] += template.numel
    expert_payload = [0] * rollout.tp
    for j in range(rollout.tp):
        for template, found in _sources(tables, j):
            payload[j] += template.numel
            if found[0].ep is not None:
                expert_payload[j] += template.numel
    return _Global(groups, local, gather_chunks, _a2a_buckets(a2a, max(1, bucket_elems // 2)),
                   {j: _zero_fill(tables, j) for j in range(rollout.tp)}, payload, expert_payload, tables)


# ------------------------------------------------------------------------------------------------
# Per-rank plan
# ------------------------------------------------------------------------------------------------

def _segment(tr: _Transfer, src_buffer: int | None, dst_buffer: int | None) -> Segment:
    """A segment for ``tr``: from its training param (or a buffer at ``src_buffer``) to its rollout
    param (or a buffer at ``dst_buffer``); buffers are dense (stride = cols)."""
    if src_buffer is None:
        src = (tr.src_param, tr.src_row * tr.src_stride + tr.src_col, tr.src_stride)
    else:
        src = (None, src_buffer, tr.cols)
    if dst_buffer is None:
        dst = (tr.dst_param, tr.dst_row * tr.dst_stride + tr.dst_col, tr.dst_stride)
    else:
        dst = (None, dst_buffer, tr.cols)
    return _compact(Segment(src[0], src[1], dst[0], dst[1], tr.rows, tr.cols, src[2], dst[2]))


def _compact(seg: Segment) -> Segment:
    """Rows contiguous on both sides are one long row (one memcpy instead of many)."""
    if seg.rows > 1 and seg.src_stride == seg.row_elems and seg.dst_stride == seg.row_elems:
        return dataclasses.replace(seg, rows=1, row_elems=seg.numel)
    return seg


def _merge(segments: list[Segment]) -> tuple[Segment, ...]:
    """Fuse consecutive single-row segments that continue each other on both sides."""
    out: list[Segment] = []
    for seg in segments:
        prev = out[-1] if out else None
        if (prev is not None and prev.rows == 1 and seg.rows == 1
                and prev.src_param == seg.src_param and prev.dst_param == seg.dst_param
                and prev.src_offset + prev.row_elems == seg.src_offset
                and prev.dst_offset + prev.row_elems == seg.dst_offset):
            out[-1] = dataclasses.replace(prev, row_elems=prev.row_elems + seg.row_elems,
                                          src_stride=prev.row_elems + seg.row_elems,
                                          dst_stride=prev.row_elems + seg.row_elems)
        else:
            out.append(seg)
    return tuple(out)


def _gather_bucket(index: int, group: tuple[int, ...], chunks: list[list[_Transfer]], rank: int) -> Bucket:
    slot = max(sum(tr.numel for tr in c) for c in chunks)
    me = group.index(rank)
    pack, unpack = [], []
    for member, chunk in enumerate(chunks):
        offset = member * slot
        for tr in chunk:
            if member == me:
                pack.append(_segment(tr, None, offset))
            unpack.append(_segment(tr, offset, None))
            offset += tr.numel
    own = sum(tr.numel for tr in chunks[me])
    received = sum(tr.numel for c in chunks for tr in c) - own
    return Bucket(index, ALL_GATHER, group, slot * len(group), 0, slot, (), (), _merge(pack), _merge(unpack),
                  own * (len(group) - 1), received)


def _a2a_bucket(index: int, world: int, transfers: list[_Route], rank: int) -> Bucket:
    outgoing = sorted((t for t in transfers if t.src == rank), key=lambda t: t.dst)  # stable: plan order kept
    incoming = sorted((t for t in transfers if t.dst == rank), key=lambda t: t.src)
    send_splits, recv_splits = [0] * world, [0] * world
    pack, unpack = [], []
    offset = 0
    for _, dst, tr in outgoing:
        pack.append(_segment(tr, None, offset))
        offset += tr.numel
        send_splits[dst] += tr.numel
    offset = 0
    for src, _, tr in incoming:
        unpack.append(_segment(tr, offset, None))
        offset += tr.numel
        recv_splits[src] += tr.numel
    return Bucket(index, ALL_TO_ALL, tuple(range(world)), sum(recv_splits), sum(send_splits), 0,
                  tuple(send_splits), tuple(recv_splits), _merge(pack), _merge(unpack),
                  sum(send_splits), sum(recv_splits))


def plan_reshard(
    config: ModelConfig,
    training: AnyTrainingLayout,
    rollout: RolloutLayout,
    rank: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: str = "bfloat16",
) -> ReshardPlan:
    """The plan of global ``rank`` for moving the actor from ``training`` to ``rollout`` layout."""
    if dtype not in ELEMENT_SIZES:
        raise InputError(f"dtype: expected one of {sorted(ELEMENT_SIZES)}, found {dtype!r}")
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InputError(f"bucket_bytes: expected a positive integer, found {bucket_bytes!r}")
    element_size = ELEMENT_SIZES[dtype]
    g = _global_plan(config, training, rollout, bucket_bytes // element_size)
    groups = g.groups
    training.coords(rank)  # validates the rank
    j = groups.rollout_tp_rank[rank]
    buckets: list[Bucket] = []
    micro = ()
    if groups.case == HYBRIDFLOW:
        micro = groups.micro_dp_group_of(rank)
        for chunks in g.gather_chunks.get(micro, ()):
            buckets.append(_gather_bucket(len(buckets), micro, chunks, rank))
    for transfers in g.a2a_buckets:
        buckets.append(_a2a_bucket(len(buckets), training.world_size, transfers, rank))
    model_elems = sum(g.payload)
    expert_elems = sum(g.expert_payload)
    # What this rank's rollout shard needs that its own training shard holds, from the layouts alone (not
    # from the choices above): the bound of a layout that holds each rank to its own shard.
    def held() -> int:
        return sum(t.numel for t, found in _sources(g.tables, j) if any(_holds(training, rank, h) for h in found))

    bound = training.received_bound(rollout.tp, model_elems, expert_elems, g.payload[j], held)
    formula = None if bound is None else float(bound * element_size)
    return ReshardPlan(
        rank=rank, case=groups.case, reason=groups.reason, training=training, rollout=rollout,
        rollout_tp_rank=j, rollout_tp_group=groups.rollout_tp_group_of(rank), micro_dp_group=micro,
        dtype=dtype, bucket_bytes=bucket_bytes,
        local=_merge([_segment(tr, None, None) for tr in g.local[rank]]),
        buckets=tuple(buckets), zero_fill=tuple(g.zero_fill[j]),
        model_bytes=model_elems * element_size, expert_bytes=expert_elems * element_size, bytes_formula=formula,
    )
