"""The distributed data plane: a batch whose rows stay on the ranks that produced them.

Without it (the legacy path) every worker-group call ends in an object all-gather, so every rank of the
job holds the whole batch after every call. With it (verl's ``transfer_queue.enable=true``) a call's result
is a :class:`ShardedBatch`: every rank holds the same *metadata* (row count, field names, dtypes and shapes,
which rank holds each row's values, the small per-row ``non_tensor_batch`` and ``meta_info``), and only the
ranks that produced the rows hold their tensors. The next call's dispatch moves each row it needs from the
rank holding it straight to the ranks that consume it (one ``all_to_all`` of packed bytes), and only where
the two differ. Every rank computes every send and receive size from the shared metadata, so no sizes are
exchanged and a step where nothing has to move runs no collective at all.

A batch is a list of column groups: the fields one call produced, with one holder rank per row
(``owner``). Fields of the same row may sit on different ranks (the rollout's responses on a rollout
replica's first rank, the actor's log-probs on a Megatron replica's last stage); a consumer receives each
field from wherever it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.protocol import DataProto


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One field's per-row dtype and shape (the batch dimension left out)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty(0, dtype=self.dtype).element_size()

    @classmethod
    def of(cls, tensor: torch.Tensor) -> FieldSpec:
        return cls(tensor.dtype, tuple(tensor.shape[1:]))


@dataclasses.dataclass
class TransferStats:
    """What this rank's data plane moved since the last :meth:`reset` (the bench's per-rank figures)."""

    bytes_received: int = 0  # tensor bytes that arrived from other ranks
    bytes_sent: int = 0
    bytes_kept: int = 0  # tensor bytes a consumer found on its own rank
    collectives: int = 0
    object_bytes: int = 0  # metadata moved by object collectives
    seconds: float = 0.0

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


REPLICATED = -1  # an owner meaning "every rank holds this row" (the prompts every rank's dataloader reads)


class ColumnGroup:
    """Some fields of every row of a batch; row ``i``'s values live on global rank ``owner[i]``, or on every
    rank when the whole group is :data:`REPLICATED`.

    ``local[name]`` holds this rank's rows (the positions ``i`` with ``owner[i] == rank``, or every row of a
    replicated group, in batch order); ``fields`` and ``owner`` are the same on every rank.
    """

    def __init__(self, fields: Mapping[str, FieldSpec], owner: np.ndarray, local: Mapping[str, torch.Tensor],
                 rank: int):
        self.fields = dict(fields)
        self.owner = np.asarray(owner, dtype=np.int64)
        self.rank = rank
        self.local = dict(local)
        self.replicated = bool(self.owner.size) and bool((self.owner == REPLICATED).all())
        if (self.owner == REPLICATED).any() and not self.replicated:
            raise ValueError("data plane: a column group is replicated on every rank or held row by row, not both")
        # batch position of each local row
        self._positions = np.arange(self.owner.size) if self.replicated else np.flatnonzero(self.owner == rank)
        for name, spec in self.fields.items():
            tensor = self.local.get(name)
            if tensor is None and self._positions.size:
                raise ValueError(f"data plane: rank {rank} holds {self._positions.size} rows of field {name!r}, "
                                 f"found no tensor")
            if tensor is not None and (tensor.size(0) != self._positions.size or FieldSpec.of(tensor) != spec):
                raise ValueError(f"data plane: field {name!r} on rank {rank}: expected {self._positions.size} rows "
                                 f"of {spec}, found {tuple(tensor.shape)} {tensor.dtype}")

    def local_index(self) -> dict[int, int]:
        """Batch position -> row of this rank's ``local`` tensors."""
        return {int(p): i for i, p in enumerate(self._positions)}

    @classmethod
    def replicate(cls, tensors: Mapping[str, torch.Tensor], rows: int, rank: int) -> ColumnGroup:
        """Tensors every rank holds in full (the same values everywhere)."""
        return cls({k: FieldSpec.of(v) for k, v in tensors.items()}, np.full(rows, REPLICATED), tensors, rank)

    def reordered(self, order: np.ndarray) -> ColumnGroup:
        """The same rows in batch order ``order`` (position j holds old position order[j]); local rows move
        between local slots only, never between ranks."""
        owner = self.owner[order]
        mine = order if self.replicated else order[owner == self.rank]  # old positions of my rows, new order
        index = self.local_index()
        slots = torch.as_tensor([index[int(p)] for p in mine], dtype=torch.long)
        local = {name: t.index_select(0, slots) for name, t in self.local.items()}
        return ColumnGroup(self.fields, owner, local, self.rank)

    def without(self, names: Iterable[str]) -> ColumnGroup:
        names = set(names)
        return ColumnGroup({k: v for k, v in self.fields.items() if k not in names}, self.owner,
                           {k: v for k, v in self.local.items() if k not in names}, self.rank)


class ShardedBatch:
    """A batch of ``len(self)`` rows whose tensors stay where they were produced (see the module doc)."""

    def __init__(self, rows: int, groups: Sequence[ColumnGroup] = (), non_tensor_batch: Mapping | None = None,
                 meta_info: Mapping | None = None):
        self.rows = rows
        self.groups = [g for g in groups if g.fields]
        self.non_tensor_batch = dict(non_tensor_batch or {})
        self.meta_info = dict(meta_info or {})
        for g in self.groups:
            if g.owner.shape != (rows,):
                raise ValueError(f"data plane: expected an owner per row ({rows}), found {g.owner.shape}")
        for key, value in self.non_tensor_batch.items():
            if len(value) != rows:
                raise ValueError(f"data plane: non_tensor_batch[{key!r}]: expected {rows} rows, found {len(value)}")

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

    # ------------------------------------------------------------------ metadata-only operations
    def union(self, other: ShardedBatch) -> ShardedBatch:
        """Add ``other``'s fields (in place, returns self); a field both hold is now ``other``'s."""
        if other.rows != self.rows:
            raise ValueError(f"data plane union: expected {self.rows} rows, found {other.rows}")
        replaced = set(other.fields)
        self.groups = [g.without(replaced) for g in self.groups]
        self.groups = [g for g in self.groups if g.fields] + list(other.groups)
        self.non_tensor_batch.update(other.non_tensor_batch)
        self.meta_info.update(other.meta_info)
        return self

    def reorder(self, order: Sequence[int] | torch.Tensor) -> None:
        """verl's ``DataProto.reorder``, in place: a permutation of the metadata; no row changes rank."""
        order = np.asarray(torch.as_tensor(order).tolist(), dtype=np.int64)
        if sorted(order.tolist()) != list(range(self.rows)):
            raise ValueError(f"data plane reorder: expected a permutation of {self.rows} rows")
        self.groups = [g.reordered(order) for g in self.groups]
        self.non_tensor_batch = {k: v[order] for k, v in self.non_tensor_batch.items()}

    def pop(self, names: Iterable[str]) -> None:
        names = list(names)
        for name in names:
            self.holder(name)
        self.groups = [g.without(names) for g in self.groups]
        self.groups = [g for g in self.groups if g.fields]

    # ------------------------------------------------------------------ moving rows
    def gather(self, needs: Sequence[np.ndarray], fields: Iterable[str] | None = None,
               non_tensor: bool = True, group=None) -> DataProto:
        """This rank's rows ``needs[rank]`` (batch positions, repeats allowed) as a DataProto, each field's
        values brought from the rank holding them. Collective over every rank of the job (``needs`` has one
        entry per rank, the same on every rank)."""
        import time

        start = time.perf_counter()
        rank, world = _world()
        if len(needs) != world:
            raise ValueError(f"data plane gather: expected the needs of {world} ranks, found {len(needs)}")
        wanted = list(self.fields) if fields is None else list(fields)
        for name in wanted:
            self.holder(name)
        by_group = [(g, [n for n in wanted if n in g.fields]) for g in self.groups]
        by_group = [(g, names) for g, names in by_group if names]
        needs = [np.asarray(n, dtype=np.int64) for n in needs]

        # send[src][dst]: the positions src sends to dst, per group, in the order dst needs them
        def sent(g: ColumnGroup, src: int, dst: int) -> np.ndarray:
            positions = needs[dst]
            return positions[g.owner[positions] == src] if src != dst and not g.replicated else positions[:0]

        def pair_bytes(src: int, dst: int) -> int:
            return sum(len(sent(g, src, dst)) * sum(g.fields[n].row_bytes for n in names) for g, names in by_group)

        sizes = [[pair_bytes(src, dst) for dst in range(world)] for src in range(world)]
        out: dict[str, torch.Tensor] = {}
        own_rows = len(needs[rank])
        for g, names in by_group:
            for name in names:
                spec = g.fields[name]
                out[name] = torch.empty((own_rows, *spec.shape), dtype=spec.dtype)
        if any(any(row) for row in sizes):
            send_parts = []
            for dst in range(world):
                for g, names in by_group:
                    index = g.local_index()
                    slots = torch.as_tensor([index[int(p)] for p in sent(g, rank, dst)], dtype=torch.long)
                    for name in names:
                        if slots.numel():
                            send_parts.append(_as_bytes(g.local[name].index_select(0, slots)))
            send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=torch.uint8)
            recv = torch.empty(sum(sizes[src][rank] for src in range(world)), dtype=torch.uint8)
            dist.all_to_all_single(recv, send, output_split_sizes=[sizes[src][rank] for src in range(world)],
                                   input_split_sizes=sizes[rank], group=group or object_group())
            STATS.collectives += 1
            STATS.bytes_sent += send.numel()
            STATS.bytes_received += recv.numel()
            offset = 0
            for src in range(world):
                for g, names in by_group:
                    mask = g.owner[needs[rank]] == src if src != rank and not g.replicated \
                        else np.zeros(own_rows, dtype=bool)
                    count = int(mask.sum())
                    if not count:
                        continue
                    rows = torch.as_tensor(np.flatnonzero(mask), dtype=torch.long)
                    for name in names:
                        spec = g.fields[name]
                        nbytes = count * spec.row_bytes
                        values = _from_bytes(recv[offset:offset + nbytes], spec, count)
                        out[name].index_copy_(0, rows, values)
                        offset += nbytes
        for g, names in by_group:  # rows this rank holds itself
            mask = np.ones(own_rows, dtype=bool) if g.replicated else g.owner[needs[rank]] == rank
            if mask.any():
                index = g.local_index()
                slots = torch.as_tensor([index[int(p)] for p in needs[rank][mask]], dtype=torch.long)
                rows = torch.as_tensor(np.flatnonzero(mask), dtype=torch.long)
                for name in names:
                    values = g.local[name].index_select(0, slots)
                    out[name].index_copy_(0, rows, values)
                    STATS.bytes_kept += values.numel() * values.element_size()
        STATS.seconds += time.perf_counter() - start
        non_tensor_batch = ({k: v[needs[rank]] for k, v in self.non_tensor_batch.items()} if non_tensor else {})
        return DataProto.from_dict(out, non_tensor_batch, dict(self.meta_info)) if out else \
            DataProto(non_tensor_batch=non_tensor_batch, meta_info=dict(self.meta_info))

    def to_dataproto(self, fields: Iterable[str] | None = None, group=None) -> DataProto:
        """Every row on every rank (the legacy path's state; for dumps, debugging and tests)."""
        _, world = _world()
        everything = np.arange(self.rows)
        return self.gather([everything] * world, fields, group=group)

    def map_rows(self, fn: Callable[[DataProto], Mapping[str, torch.Tensor]], inputs: Iterable[str],
                 anchor: str, group=None) -> ShardedBatch:
        """``fn`` on the rows each rank holds of field ``anchor`` (their ``inputs`` brought to it); its
        result fields stay there: a :class:`ShardedBatch` of new fields with ``anchor``'s holders. Row-local
        controller math (rewards, KL penalty, GAE, group advantages when whole groups share a holder)."""
        rank, world = _world()
        holder = self.holder(anchor)
        if holder.replicated:  # every rank computes every row
            local = self.gather([np.arange(self.rows)] * world, inputs, group=group)
            result = dict(fn(local))
            return ShardedBatch(self.rows, [ColumnGroup.replicate(result, self.rows, rank)],
                                meta_info=dict(self.meta_info))
        needs = [np.flatnonzero(holder.owner == r) for r in range(world)]
        local = self.gather(needs, inputs, group=group)
        result = dict(fn(local)) if len(needs[rank]) else {}
        return self.from_local_results(holder.owner, result, group=group)

    def from_local_results(self, owner: np.ndarray, result: Mapping[str, torch.Tensor],
                           group=None) -> ShardedBatch:
        """A batch of this one's rows whose fields ``result`` each rank computed for the rows it holds
        (``owner``); field specs are agreed by one small object all-gather."""
        rank, world = _world()
        specs = {name: FieldSpec.of(t) for name, t in result.items()}
        every = all_gather_small(specs, group=group)
        agreed: dict[str, FieldSpec] = {}
        for r, theirs in enumerate(every):
            if not (owner == r).any():
                continue
            for name, spec in theirs.items():
                if agreed.setdefault(name, spec) != spec:
                    raise ValueError(f"data plane: field {name!r}: ranks disagree on its shape ({agreed[name]} vs "
                                     f"{spec})")
        local = {name: result[name] for name in agreed if name in result}
        return ShardedBatch(self.rows, [ColumnGroup(agreed, owner, local, rank)], meta_info=dict(self.meta_info))

    def row_values(self, fn: Callable[[DataProto], torch.Tensor], inputs: Iterable[str], anchor: str,
                   group=None) -> torch.Tensor:
        """A small per-row result (``fn`` -> [rows_here, k]) computed where ``anchor`` is held, on every rank
        in batch order: what the controller reads (lengths for balancing, scores, metric summaries)."""
        rank, world = _world()
        holder = self.holder(anchor)
        if holder.replicated:
            return fn(self.gather([np.arange(self.rows)] * world, inputs, group=group))
        needs = [np.flatnonzero(holder.owner == r) for r in range(world)]
        local = self.gather(needs, inputs, group=group)
        values = fn(local) if len(needs[rank]) else None
        every = all_gather_small((needs[rank], values), group=group)
        out = None
        for positions, part in every:
            if part is None:
                continue
            if out is None:
                out = torch.empty((self.rows, *part.shape[1:]), dtype=part.dtype)
            out[torch.as_tensor(positions, dtype=torch.long)] = part
        return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _from_bytes(raw: torch.Tensor, spec: FieldSpec, rows: int) -> torch.Tensor:
    return raw.clone().view(spec.dtype).view(rows, *spec.shape)


def all_gather_small(obj: Any, group=None) -> list[Any]:
    """Every rank's small ``obj`` (metadata, per-row scalars) on every rank; counted in ``STATS.object_bytes``."""
    import pickle

    rank, world = _world()
    if world == 1:
        return [obj]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, obj, group=group or object_group())
    STATS.object_bytes += sum(len(pickle.dumps(g)) for i, g in enumerate(gathered) if i != rank)
    return gathered


def dispatch_positions(rows: int, dp: int) -> tuple[list[np.ndarray], int]:
    """Each DP replica's batch positions for a batch of ``rows`` (padded as ``pad_dataproto_to_divisor``
    pads: copies of the first rows), and the pad size."""
    pad = (-rows) % dp
    positions = np.concatenate([np.arange(rows), np.arange(pad) % max(rows, 1)]).astype(np.int64)
    share = len(positions) // dp
    return [positions[d * share:(d + 1) * share] for d in range(dp)], pad


def batch_from_outputs(holders: Sequence[int], local: DataProto | None, pad_inputs: int, inputs: int,
                       group=None) -> ShardedBatch:
    """The batch a dispatch's outputs form. ``holders``: the global rank holding each DP replica's output, in
    replica order (the same on every rank); ``local``: this rank's output (None where it holds none). The
    outputs have ``r`` rows per input row (generation: n); the rows made from the ``pad_inputs`` padding
    inputs (the last ones) are dropped. Field specs, row counts, ``non_tensor_batch`` and ``meta_info``
    travel by one small object all-gather."""
    rank, _ = _world()
    tensors = dict(local.batch.items()) if local is not None and local.batch is not None else {}
    summary = None
    if local is not None:
        summary = (len(local), {k: FieldSpec.of(v) for k, v in tensors.items()}, dict(local.non_tensor_batch),
                   dict(local.meta_info))
    every = all_gather_small(summary, group=group)
    specs, non_tensor, metas, counts = None, {}, [], []
    for holder in holders:
        theirs = every[holder]
        if theirs is None:
            raise ValueError(f"data plane: rank {holder} was to hold a replica's output, found none")
        rows, their_specs, their_non_tensor, their_meta = theirs
        if specs is None:
            specs = their_specs
        elif their_specs != specs:
            raise ValueError(f"data plane: outputs disagree on their fields: {specs} vs {their_specs}")
        for key, value in their_non_tensor.items():
            non_tensor.setdefault(key, []).append(value)
        metas.append(their_meta)
        counts.append(rows)
    total = sum(counts)
    per_input = total // (inputs + pad_inputs) if inputs + pad_inputs else 0
    keep = total - pad_inputs * per_input
    owner = np.concatenate([np.full(rows, holder, dtype=np.int64) for holder, rows in zip(holders, counts,
                                                                                          strict=True)])
    kept = owner[:keep]
    # Padding rows are the last of the batch: on their holder they are its last local rows.
    mine_kept = int((kept == rank).sum())
    tensors = {k: v[:mine_kept] for k, v in tensors.items()} if (owner == rank).any() else {}
    non_tensor_batch = {k: np.concatenate(v)[:keep] for k, v in non_tensor.items()}
    return ShardedBatch(keep, [ColumnGroup(specs or {}, kept, tensors, rank)], non_tensor_batch,
                        _merge_meta(metas))


def _merge_meta(metas: Sequence[dict]) -> dict:
    """meta_info of several outputs merged as DataProto.concat merges it (metrics into lists)."""
    parts = [DataProto(meta_info=m) for m in metas]
    return DataProto.concat(parts).meta_info if parts else {}


__all__ = ["REPLICATED", "STATS", "ColumnGroup", "FieldSpec", "ShardedBatch", "TransferStats", "all_gather_small",
           "batch_from_outputs", "dispatch_positions"]
