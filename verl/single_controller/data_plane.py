"""The distributed data plane: a batch whose rows stay on the ranks that produced them.

Without it (the legacy path) every worker-group call ends in an object all-gather, so every rank of the
job holds the whole batch after every call. With it (verl's ``transfer_queue.enable=true``) a call's result
is a :class:`ShardedBatch`: every rank holds the same *metadata* (the row count, the field names, dtypes and
shapes, which rank holds each row's values) and only the ranks that produced the rows hold their values,
tensors and per-row objects alike (``uid``, ``data_source``, ground truths). The next call's dispatch moves
each row it needs from the rank holding it straight to the ranks that consume it, point to point, and only
where the two differ; ranks that exchange nothing do not communicate. The holders of a call's output are
known from the dispatch itself, so the metadata that travels per call is one small summary from one rank.

A batch is a list of column groups: the fields one call produced, with one holder rank per row
(``owner``), or a group every rank holds whole (:data:`REPLICATED`: the prompts every rank's dataloader
read). Fields of one row may sit on different ranks (the rollout's responses on a rollout replica's first
rank, the actor's log-probs on a Megatron replica's last stage); a consumer receives each from its holder.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.protocol import DataProto

REPLICATED = -1  # an owner meaning "every rank holds this row"


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One field's per-row dtype and shape (the batch dimension left out); ``dtype`` None: a column of
    Python objects (verl's ``non_tensor_batch``)."""

    dtype: torch.dtype | None
    shape: tuple[int, ...] = ()

    @property
    def is_object(self) -> bool:
        return self.dtype is None

    @property
    def row_bytes(self) -> int:
        if self.is_object:
            return 0
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty(0, dtype=self.dtype).element_size()

    @classmethod
    def of(cls, value: torch.Tensor | np.ndarray) -> FieldSpec:
        if isinstance(value, torch.Tensor):
            return cls(value.dtype, tuple(value.shape[1:]))
        return cls(None)


@dataclasses.dataclass
class TransferStats:
    """What this rank's controller moved since the last :meth:`reset` (the bench's per-rank figures)."""

    bytes_received: int = 0  # row values (tensors and objects) that arrived from other ranks
    bytes_sent: int = 0
    object_bytes: int = 0  # metadata and legacy batches received through object collectives
    shard_bytes: int = 0  # what this rank's workers consumed: the tensors of their DataProto arguments
    seconds: float = 0.0  # time spent moving rows and metadata

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)


STATS = TransferStats()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_OBJECT_GROUP: list[Any] = []


def object_group():
    """The gloo group the controller's data moves over: its tensors are on the CPU (NCCL would need them on
    a GPU, and cannot carry pickled objects). The default group when that is gloo already."""
    if not _OBJECT_GROUP:
        _OBJECT_GROUP.append(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))
    return _OBJECT_GROUP[0]


def _index(values: torch.Tensor | np.ndarray, slots: np.ndarray) -> torch.Tensor | np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.index_select(0, torch.as_tensor(slots, dtype=torch.long))
    return values[slots]


class ColumnGroup:
    """Some fields of every row of a batch; row ``i``'s values live on global rank ``owner[i]``, or on every
    rank when the whole group is :data:`REPLICATED`.

    ``local[name]`` holds this rank's rows (the positions ``i`` with ``owner[i] == rank``, or every row of a
    replicated group, in batch order): a tensor, or an object array; ``fields`` and ``owner`` are the same on
    every rank.
    """

    def __init__(self, fields: Mapping[str, FieldSpec], owner: np.ndarray,
                 local: Mapping[str, torch.Tensor | np.ndarray], rank: int):
        self.fields = dict(fields)
        self.owner = np.asarray(owner, dtype=np.int64)
        self.rank = rank
        self.local = dict(local)
        self.replicated = bool(self.owner.size) and bool((self.owner == REPLICATED).all())
        if (self.owner == REPLICATED).any() and not self.replicated:
            raise ValueError("data plane: a column group is replicated on every rank or held row by row, not both")
        # the batch position of each local row
        self.positions = np.arange(self.owner.size) if self.replicated else np.flatnonzero(self.owner == rank)
        for name, spec in self.fields.items():
            value = self.local.get(name)
            if value is None and self.positions.size:
                raise ValueError(f"data plane: rank {rank} holds {self.positions.size} rows of field {name!r}, "
                                 f"found no values")
            if value is not None and (len(value) != self.positions.size or FieldSpec.of(value) != spec):
                raise ValueError(f"data plane: field {name!r} on rank {rank}: expected {self.positions.size} rows "
                                 f"of {spec}, found {len(value)} of {FieldSpec.of(value)}")

    @classmethod
    def replicate(cls, values: Mapping[str, torch.Tensor | np.ndarray], rows: int, rank: int) -> ColumnGroup:
        """Values every rank holds in full (the same everywhere)."""
        return cls({k: FieldSpec.of(v) for k, v in values.items()}, np.full(rows, REPLICATED), values, rank)

    def slots(self, positions: np.ndarray) -> np.ndarray:
        """Local rows of the batch ``positions`` (all held here)."""
        return positions if self.replicated else np.searchsorted(self.positions, positions)

    def reordered(self, order: np.ndarray) -> ColumnGroup:
        """The same rows in batch order ``order`` (position j holds old position order[j]); local rows move
        between local slots only, never between ranks."""
        owner = self.owner[order]
        mine = order if self.replicated else order[owner == self.rank]  # old positions of my rows, new order
        slots = self.slots(mine)
        return ColumnGroup(self.fields, owner, {n: _index(v, slots) for n, v in self.local.items()}, self.rank)

    def without(self, names: Iterable[str]) -> ColumnGroup:
        names = set(names)
        return ColumnGroup({k: v for k, v in self.fields.items() if k not in names}, self.owner,
                           {k: v for k, v in self.local.items() if k not in names}, self.rank)


class ShardedBatch:
    """A batch of ``len(self)`` rows whose values stay where they were produced (see the module doc)."""

    def __init__(self, rows: int, groups: Sequence[ColumnGroup] = (), meta_info: Mapping | None = None,
                 row_ids: np.ndarray | None = None):
        self.rows = rows
        self.groups = [g for g in groups if g.fields]
        self.meta_info = dict(meta_info or {})
        # A stable id per row (metadata, the same on every rank): a prompt's id from its step and index, a
        # generated row's from its prompt's (id * n + j). Resumes and replay buffers address rows by id.
        self.row_ids = np.arange(rows, dtype=np.int64) if row_ids is None else np.asarray(row_ids, dtype=np.int64)
        if self.row_ids.shape != (rows,):
            raise ValueError(f"data plane: expected a row id per row ({rows}), found {self.row_ids.shape}")
        for g in self.groups:
            if g.owner.shape != (rows,):
                raise ValueError(f"data plane: expected an owner per row ({rows}), found {g.owner.shape}")

    @classmethod
    def replicated(cls, data: DataProto, first_id: int = 0) -> ShardedBatch:
        """A DataProto every rank holds whole (the prompts of a step) as the data plane's first batch; its rows
        get the ids ``first_id``, ``first_id + 1``, ..."""
        rank, _ = _world()
        values = {**(dict(data.batch.items()) if data.batch is not None else {}), **data.non_tensor_batch}
        return cls(len(data), [ColumnGroup.replicate(values, len(data), rank)], data.meta_info,
                   first_id + np.arange(len(data), dtype=np.int64))

    def positions(self, row_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The batch positions of rows given by id (no communication: ids are metadata)."""
        row_ids = np.asarray(row_ids, dtype=np.int64)
        order = np.argsort(self.row_ids, kind="stable")
        found = np.searchsorted(self.row_ids, row_ids, sorter=order)
        found = np.minimum(found, len(order) - 1) if len(order) else found
        if not len(order) or (self.row_ids[order[found]] != row_ids).any():
            missing = row_ids[~np.isin(row_ids, self.row_ids)]
            raise KeyError(f"data plane: expected rows with ids {missing[:5].tolist()} in this batch, found none")
        return order[found]

    def __len__(self) -> int:
        return self.rows

    @property
    def fields(self) -> dict[str, FieldSpec]:
        return {name: spec for g in self.groups for name, spec in g.fields.items()}

    def keys(self) -> list[str]:
        return list(self.fields)

    def holder(self, name: str) -> ColumnGroup:
        for g in self.groups:
            if name in g.fields:
                return g
        raise KeyError(f"data plane: expected field {name!r} among {sorted(self.fields)}, found none")

    def held_here(self, anchor: str) -> np.ndarray:
        """The batch positions this rank holds of field ``anchor`` (every position for a replicated one)."""
        return self.holder(anchor).positions

    # ------------------------------------------------------------------ metadata-only operations
    def union(self, other: ShardedBatch) -> ShardedBatch:
        """Add ``other``'s fields (in place, returns self); a field both hold is now ``other``'s."""
        if other.rows != self.rows:
            raise ValueError(f"data plane union: expected {self.rows} rows, found {other.rows}")
        if not np.array_equal(other.row_ids, self.row_ids):
            raise ValueError("data plane union: expected the same rows in the same order (row ids), found others")
        replaced = set(other.fields)
        self.groups = [g.without(replaced) for g in self.groups]
        self.groups = [g for g in self.groups if g.fields] + list(other.groups)
        self.meta_info.update(other.meta_info)
        return self

    def reorder(self, order: Sequence[int] | torch.Tensor) -> None:
        """verl's ``DataProto.reorder``, in place: a permutation of the metadata; no row changes rank."""
        order = np.asarray(torch.as_tensor(order).tolist(), dtype=np.int64)
        if sorted(order.tolist()) != list(range(self.rows)):
            raise ValueError(f"data plane reorder: expected a permutation of {self.rows} rows")
        self.groups = [g.reordered(order) for g in self.groups]
        self.row_ids = self.row_ids[order]

    def pop(self, names: Iterable[str]) -> None:
        names = list(names)
        for name in names:
            self.holder(name)
        self.groups = [g.without(names) for g in self.groups]
        self.groups = [g for g in self.groups if g.fields]

    # ------------------------------------------------------------------ moving rows
    def gather(self, needs: Callable[[int], np.ndarray], fields: Iterable[str] | None = None) -> DataProto:
        """This rank's rows ``needs(rank)`` (batch positions, repeats allowed) as a DataProto, each field's
        values brought from the rank holding them. ``needs(r)`` gives any rank's positions (the same function on
        every rank). Collective over the ranks that exchange rows with this one: point to point, a byte count
        first, then the rows; ranks with nothing to exchange skip it."""
        start = time.perf_counter()
        rank, world = _world()
        wanted = list(self.fields) if fields is None else list(fields)
        for name in wanted:
            self.holder(name)
        by_group = [(g, [n for n in wanted if n in g.fields]) for g in self.groups]
        by_group = [(g, names) for g, names in by_group if names]
        mine = np.asarray(needs(rank), dtype=np.int64)
        moving = [(g, names) for g, names in by_group if not g.replicated]

        # What this rank sends to each other rank: the rows it holds of their needs, in their order.
        sends: dict[int, bytes] = {}
        if any(g.positions.size for g, _ in moving):
            for dst in range(world):
                if dst == rank:
                    continue
                theirs = np.asarray(needs(dst), dtype=np.int64)
                values = []
                for g, names in moving:
                    held = theirs[g.owner[theirs] == rank]
                    if held.size:
                        slots = g.slots(held)
                        values += [_index(g.local[n], slots) for n in names]
                if values:
                    sends[dst] = _pack(values)
        # What this rank receives, from whom: the holders of its needs.
        sources = sorted({int(o) for g, _ in moving for o in g.owner[mine]} - {rank}) if mine.size else []
        received = _exchange(sends, sources)

        out: dict[str, torch.Tensor | np.ndarray] = {}
        for g, names in by_group:
            for name in names:
                spec = g.fields[name]
                out[name] = np.empty(len(mine), dtype=object) if spec.is_object else \
                    torch.empty((len(mine), *spec.shape), dtype=spec.dtype)
        for src in sources:
            # The message holds, group by group, the rows src holds of this rank's needs, in need order.
            layout = [(g, names, np.flatnonzero(g.owner[mine] == src)) for g, names in moving]
            layout = [(g, names, rows) for g, names, rows in layout if rows.size]
            specs = [(g.fields[n], len(rows)) for g, names, rows in layout for n in names]
            values = iter(_unpack(received[src], specs))
            for g, names, rows in layout:
                for name in names:
                    _assign(out[name], rows, next(values))
        for g, names in by_group:  # rows this rank holds itself
            rows = np.arange(len(mine)) if g.replicated else np.flatnonzero(g.owner[mine] == rank)
            if rows.size:
                slots = g.slots(mine[rows])
                for name in names:
                    _assign(out[name], rows, _index(g.local[name], slots))
        STATS.seconds += time.perf_counter() - start
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        objects = {k: v for k, v in out.items() if isinstance(v, np.ndarray)}
        if tensors:
            return DataProto.from_dict(tensors, objects, dict(self.meta_info))
        return DataProto(non_tensor_batch=objects, meta_info=dict(self.meta_info))

    def to_dataproto(self, fields: Iterable[str] | None = None) -> DataProto:
        """Every row on every rank (the legacy path's state; for debugging and tests)."""
        everything = np.arange(self.rows)
        return self.gather(lambda r: everything, fields)

    def local_rows(self, anchor: str, inputs: Iterable[str]) -> tuple[np.ndarray, DataProto]:
        """The rows this rank holds of ``anchor`` (positions, and those rows with their ``inputs`` brought here)."""
        holder = self.holder(anchor)
        if holder.replicated:
            everything = np.arange(self.rows)
            return everything, self.gather(lambda r: everything, inputs)
        owner = holder.owner
        return holder.positions, self.gather(lambda r: np.flatnonzero(owner == r), inputs)

    def map_rows(self, fn: Callable[[DataProto], Mapping[str, torch.Tensor | np.ndarray]], inputs: Iterable[str],
                 anchor: str) -> ShardedBatch:
        """``fn`` on the rows each rank holds of field ``anchor`` (their ``inputs`` brought to it); its
        result fields stay there: a :class:`ShardedBatch` of new fields with ``anchor``'s holders. Row-local
        controller math (rewards, the KL penalty, advantages when whole groups share a holder)."""
        positions, rows = self.local_rows(anchor, inputs)
        result = dict(fn(rows)) if len(positions) else {}
        return self.from_local_results(self.holder(anchor).owner, result)

    def from_local_results(self, owner: np.ndarray, result: Mapping[str, torch.Tensor | np.ndarray]) -> ShardedBatch:
        """A batch of this one's rows whose fields ``result`` each rank computed for the rows it holds
        (``owner``); the field specs come from the first row's holder (one small broadcast)."""
        rank, world = _world()
        if (owner == REPLICATED).all():
            return ShardedBatch(self.rows, [ColumnGroup.replicate(result, self.rows, rank)], self.meta_info,
                                self.row_ids)
        specs = broadcast_small({n: FieldSpec.of(v) for n, v in result.items()}, src=int(owner[0])) \
            if world > 1 else {n: FieldSpec.of(v) for n, v in result.items()}
        if (owner == rank).any() and set(specs) != set(result):
            raise ValueError(f"data plane: rank {rank} computed fields {sorted(result)}, rank {owner[0]} "
                             f"{sorted(specs)}")
        return ShardedBatch(self.rows, [ColumnGroup(specs, owner, result, rank)], self.meta_info, self.row_ids)

    def row_values(self, fn: Callable[[DataProto], torch.Tensor], inputs: Iterable[str], anchor: str) -> torch.Tensor:
        """A small per-row result (``fn`` -> [rows_here, ...]) computed where ``anchor`` is held, on every rank
        in batch order (a global decision needs it: balance_batch's lengths, validation scores). The values
        travel as one tensor all-gather (padded to the largest holder's rows); every rank knows whose rows are
        whose from the metadata, so no positions travel."""
        positions, rows = self.local_rows(anchor, inputs)
        holder = self.holder(anchor)
        if holder.replicated:
            return fn(rows)
        rank, world = _world()
        values = fn(rows) if len(positions) else None
        spec = FieldSpec.of(values) if values is not None else None
        spec = broadcast_small(spec, src=int(holder.owner[0])) if world > 1 else spec
        counts = np.bincount(holder.owner, minlength=world)
        padded = torch.zeros((int(counts.max()), *spec.shape), dtype=spec.dtype)
        if values is not None:
            padded[:len(values)] = values
        if world == 1:
            return padded
        start = time.perf_counter()
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=object_group())
        STATS.bytes_received += padded.numel() * padded.element_size() * (world - 1)
        STATS.seconds += time.perf_counter() - start
        out = torch.empty((self.rows, *spec.shape), dtype=spec.dtype)
        for r in range(world):
            where = np.flatnonzero(holder.owner == r)
            if where.size:
                out[torch.as_tensor(where, dtype=torch.long)] = parts[r][:where.size]
        return out

    def reduce_rows(self, fn: Callable[[DataProto], Mapping[str, torch.Tensor]], inputs: Iterable[str],
                    anchor: str, ops: Mapping[str, str]) -> dict[str, float]:
        """Batch-wide reductions of per-rank partials: ``fn(rows here) -> {name: scalar}``, reduced by
        ``ops[name]`` (``sum``, ``max`` or ``min``) over the ranks; ranks without rows add the identity. One
        all-reduce per op of a few numbers, whatever the batch size."""
        positions, rows = self.local_rows(anchor, inputs)
        part = {k: float(v) for k, v in fn(rows).items()} if len(positions) else {}
        sums = [n for n, o in ops.items() if o == "sum"]
        extremes = [n for n, o in ops.items() if o in ("max", "min")]
        # max and min in one MAX all-reduce (min x = -max -x); ranks without rows add identities
        signs = {n: 1.0 if ops[n] == "max" else -1.0 for n in extremes}
        totals = torch.tensor([part.get(n, 0.0) for n in sums], dtype=torch.float64)
        peaks = torch.tensor([signs[n] * part.get(n, signs[n] * float("-inf")) for n in extremes],
                             dtype=torch.float64)
        if not self.holder(anchor).replicated and dist.is_initialized() and dist.get_world_size() > 1:
            start = time.perf_counter()
            if sums:
                dist.all_reduce(totals, group=object_group())
            if extremes:
                dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=object_group())
            STATS.seconds += time.perf_counter() - start
        out = dict(zip(sums, totals.tolist(), strict=True))
        out.update({n: signs[n] * v for n, v in zip(extremes, peaks.tolist(), strict=True)})
        return out


def _pack(values: list) -> bytes:
    """Rows for one rank: the tensors' raw bytes back to back (the receiver knows their dtypes, shapes and
    row counts from the metadata), then the object columns pickled together."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    objects = [v for v in values if not isinstance(v, torch.Tensor)]
    raw = b"".join(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for v in tensors if v.numel())
    return raw + (pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL) if objects else b"")


def _unpack(data: bytes, specs: list[tuple[FieldSpec, int]]) -> list:
    """:func:`_pack`'s values, in order, given each one's spec and row count."""
    out, offset, objects = [], 0, None
    for spec, rows in specs:
        if spec.is_object:
            if objects is None:
                tensor_bytes = sum(s.row_bytes * n for s, n in specs)
                objects = iter(pickle.loads(data[tensor_bytes:]))
            out.append(next(objects))
            continue
        nbytes = spec.row_bytes * rows
        raw = torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=torch.uint8) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        out.append(raw.view(spec.dtype).view(rows, *spec.shape))
        offset += nbytes
    return out


def _assign(out: torch.Tensor | np.ndarray, rows: np.ndarray, values: torch.Tensor | np.ndarray) -> None:
    if isinstance(out, torch.Tensor):
        out.index_copy_(0, torch.as_tensor(rows, dtype=torch.long), values)
    else:
        out[rows] = values


def _exchange(sends: Mapping[int, bytes], sources: Sequence[int]) -> dict[int, bytes]:
    """Point-to-point: ``sends[dst]`` to each destination, one message from each of ``sources``; a byte count
    first, then the bytes (gloo, over the controller's group)."""
    if not sends and not sources:
        return {}
    start = time.perf_counter()
    group = object_group()
    sizes = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
    work = [dist.irecv(sizes[src], src=src, group=group) for src in sources]
    payloads = {dst: torch.frombuffer(bytearray(data), dtype=torch.uint8) for dst, data in sends.items()}
    work += [dist.isend(torch.tensor([p.numel()], dtype=torch.int64), dst=dst, group=group)
             for dst, p in payloads.items()]
    for w in work:
        w.wait()
    buffers = {src: torch.empty(int(sizes[src]), dtype=torch.uint8) for src in sources}
    work = [dist.irecv(buffers[src], src=src, group=group) for src in sources]
    work += [dist.isend(p, dst=dst, group=group) for dst, p in payloads.items()]
    for w in work:
        w.wait()
    STATS.bytes_sent += sum(p.numel() for p in payloads.values())
    STATS.bytes_received += sum(b.numel() for b in buffers.values())
    STATS.seconds += time.perf_counter() - start
    return {src: buffers[src].numpy().tobytes() for src in sources}


def max_over_ranks(value: int) -> int:
    """The largest of every rank's ``value`` (one all-reduce of one number)."""
    rank, world = _world()
    if world == 1:
        return value
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=object_group())
    return int(box)


def broadcast_small(obj: Any, src: int) -> Any:
    """Rank ``src``'s small ``obj`` on every rank; counted in ``STATS.object_bytes``."""
    rank, world = _world()
    if world == 1:
        return obj
    start = time.perf_counter()
    box = [obj if rank == src else None]
    dist.broadcast_object_list(box, src=src, group=object_group())
    if rank != src:
        STATS.object_bytes += len(pickle.dumps(box[0]))
    STATS.seconds += time.perf_counter() - start
    return box[0]


def dispatch_positions(rows: int, dp: int) -> tuple[list[np.ndarray], int]:
    """Each DP replica's batch positions for a batch of ``rows`` (padded as ``pad_dataproto_to_divisor``
    pads: copies of the first rows), and the pad size."""
    pad = (-rows) % dp
    positions = np.concatenate([np.arange(rows), np.arange(pad) % max(rows, 1)]).astype(np.int64)
    share = len(positions) // dp
    return [positions[d * share:(d + 1) * share] for d in range(dp)], pad


def batch_from_outputs(holders: Sequence[int], local: DataProto | None, share: int, pad_inputs: int,
                       input_ids: np.ndarray) -> ShardedBatch:
    """The batch a dispatch's outputs form. ``holders``: the global rank holding each DP replica's output, in
    replica order (the same on every rank); ``local``: this rank's output (None where it holds none); each
    replica had ``share`` input rows and made ``r`` rows of each (generation: n); the rows made from the
    ``pad_inputs`` padding inputs (the last ones) are dropped; ``input_ids``: the row ids of the padded
    inputs, in dispatch order (an output row's id: its input's, or input id * r + j). The first holder
    broadcasts the field specs and
    ``r``; the outputs' ``meta_info["metrics"]`` are reduced by one all-reduce per op (see
    :func:`reduce_output_metrics`); any other meta_info is the first holder's."""
    rank, world = _world()
    tensors = dict(local.batch.items()) if local is not None and local.batch is not None else {}
    values = {**tensors, **(dict(local.non_tensor_batch) if local is not None else {})}
    summary = None
    if local is not None:
        meta = {k: v for k, v in local.meta_info.items() if k != "metrics"}
        summary = ({k: FieldSpec.of(v) for k, v in values.items()}, len(local), meta,
                   sorted(_metric_entries(local.meta_info.get("metrics"))))
    first = holders[0]
    specs, first_rows, meta, metric_names = broadcast_small(summary, src=first) if world > 1 else summary
    per_input = first_rows // share if share else 0
    if local is not None and (len(local) != share * per_input or
                              {k: FieldSpec.of(v) for k, v in values.items()} != specs):
        raise ValueError(f"data plane: rank {rank}'s output ({len(local)} rows, fields {sorted(values)}) differs "
                         f"from replica 0's ({first_rows} rows, fields {sorted(specs)})")
    owner = np.concatenate([np.full(share * per_input, holder, dtype=np.int64) for holder in holders])
    keep = len(owner) - pad_inputs * per_input
    kept = owner[:keep]
    # Padding rows are the last of the batch: on their holder they are its last local rows.
    mine_kept = int((kept == rank).sum())
    values = {k: v[:mine_kept] for k, v in values.items()} if (owner == rank).any() else {}
    metrics = reduce_output_metrics(local.meta_info.get("metrics") if local is not None else None, metric_names,
                                    holders)
    if metrics:
        meta = {**meta, "metrics": metrics}
    ids = (np.asarray(input_ids, dtype=np.int64)[:, None] * per_input + np.arange(per_input)).reshape(-1) \
        if per_input != 1 else np.asarray(input_ids, dtype=np.int64)
    return ShardedBatch(keep, [ColumnGroup(specs, kept, values, rank)], meta, ids[:keep])


def _metric_entries(metrics: Any) -> dict[str, list[float]]:
    """A worker's ``meta_info["metrics"]`` (a dict, or a list of dicts) as name -> values."""
    out: dict[str, list[float]] = {}
    for entry in metrics if isinstance(metrics, list) else ([] if metrics is None else [metrics]):
        for name, value in entry.items():
            out.setdefault(name, []).extend(value if isinstance(value, list) else [value])
    return out


def reduce_output_metrics(metrics: Any, names: Sequence[str], holders: Sequence[int]) -> dict[str, list[float]]:
    """The replicas' metrics as the legacy merge + ``reduce_metrics`` would read them: for each name the
    mean over every replica's values (max/min for names that say so), as a one-element list."""
    if not names:
        return {}
    rank, world = _world()
    entries = _metric_entries(metrics)
    held = rank in holders
    sums = torch.tensor([[sum(entries.get(n, [])), len(entries.get(n, []))] for n in names] if held else
                        [[0.0, 0.0] for _ in names], dtype=torch.float64)
    # max and -min in one MAX all-reduce
    peaks = torch.tensor([max(entries.get(n, [float("-inf")])) if held else float("-inf") for n in names] +
                         [-min(entries.get(n, [float("inf")])) if held else float("-inf") for n in names],
                         dtype=torch.float64)
    if world > 1:
        start = time.perf_counter()
        dist.all_reduce(sums, group=object_group())
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=object_group())
        STATS.seconds += time.perf_counter() - start
    highs, lows = peaks[:len(names)], -peaks[len(names):]
    out = {}
    for i, name in enumerate(names):
        value = highs[i] if "max" in name else lows[i] if "min" in name else sums[i, 0] / sums[i, 1]
        out[name] = [float(value)]
    return out


__all__ = ["REPLICATED", "STATS", "ColumnGroup", "FieldSpec", "ShardedBatch", "TransferStats", "batch_from_outputs",
           "broadcast_small", "dispatch_positions", "max_over_ranks", "object_group"]
