"""Runs a :class:`CrossPoolPlan` over the bridge: training ranks pack and send, rollout ranks receive and unpack.

Per bucket and per (sender, receiver) pair, the sender posts a header ``[mode, runs, values, checksummed]`` and
then the payload. With ``verify`` the sender computes each span's checksum while its payload is on the wire and
sends all of a sync's checksums for one receiver in one message at the end; the receiver computes its own as each
bucket lands and compares them all before :meth:`PoolReceiver.receive` returns (one message per peer and sync
instead of one per span and bucket: each message costs both ranks a wake-up). The payload is either

* dense: the pair's span of the packed bucket, as is;
* delta (``delta=True``, chosen per span only when smaller): the elements whose bits changed since the
  last sync, as runs ``(start, length)`` (int32 pairs: 8 bytes a run) and their values. The sender
  keeps the last sync's packed spans (one copy of what it sends, in the rollout dtype); the receiver
  refills the span from its live weights (the inverse of the unpack program) and overwrites the runs.
  The first sync, and the first after a restart, is dense: there is nothing to compare with.

The checksum (:func:`checksum`, a position-weighted sum of the span's words modulo 2^64) is over the dense
content the receiver must end up with, so with ``verify=True`` it checks the transport and the delta
reconstruction at once; a mismatch raises :class:`WeightSyncError` naming the bucket and both ranks.

With forwarding (:attr:`PoolPlacement.forward`) a rollout rank passes each bucket on, whole, to the same tp rank
of the next replica as soon as it has landed, with the bucket's checksum in its own end-of-sync message; it
verifies what it received before its receive returns, the next replica what it forwarded. The receiver writes
into a staging buffer (one rollout shard) while the engine may go on reading its live weights;
:meth:`PoolReceiver.receive` returns when the staging buffer holds the new weights, and the caller swaps it in at a
step boundary. Buckets are pipelined on both sides: two bucket buffers
per rank at most.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import torch

from verl.hybrid_engine.cross_pool import TRAINING, CrossPoolPlan, PoolBucket
from verl.hybrid_engine.executor import ReshardBindError, _program, flat_offsets, source_programs
from verl.ops.copy_program import make_program, run_copy_program, validate_program
from verl.utils.torch_dtypes import DTYPES

DENSE, DELTA = 0, 1
_HEADER_TAG, _PAYLOAD_TAG, _RUNS_TAG = 10, 11, 12  # bucket tags: base + 4 * bucket index
_SUMS_TAG = 9  # once per sync and peer: the checksums of every span sent to it, in bucket order
_HEADER_LEN = 4  # mode, runs, values, checksummed (1: the span's checksum is in the sync's checksum message)
# Headers are posted this many buckets ahead on both sides where their content is known (dense spans need no
# packing first): gloo moves a message only once both ends posted it, so a header posted at its bucket's turn
# costs a round trip between the ranks before the payload can start.
_HEADERS_AHEAD = 4
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

METRIC_BYTES = "perf/weight_sync_bytes"
METRIC_DELTA_FRACTION = "perf/weight_sync_delta_fraction"


class WeightSyncError(RuntimeError):
    """A bucket that arrived different from what was sent (an internal error, never the user's input)."""


def _words(t: torch.Tensor) -> torch.Tensor:
    """The span's bits as integers of the element size (bit-exact comparisons: -0.0, NaN payloads)."""
    return t.view(_WORD[t.element_size()])


def checksum(t: torch.Tensor) -> int:
    """sum_i word_i * (2i + 1) mod 2^64 over the elements' bits read as unsigned integers (compiled: verl._C,
    csrc/reshard/checksum.h, on CPU and CUDA): order-sensitive, so a swapped or shifted block changes it, and
    any change to one element changes it."""
    from verl.ops.copy_program import _ext

    value = int(_ext().checksum(t.contiguous()))
    return value - (1 << 64) if value >= 1 << 63 else value  # as int64 (two's complement): it travels in a header


def encode_delta(current: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(runs [2, n] int32 of start/length, values) of the elements of ``current`` whose bits differ (a span is
    one bucket at most, far below 2^31 elements)."""
    changed = torch.nonzero(_words(current) != _words(previous)).flatten()
    if changed.numel() == 0:
        return torch.empty(2, 0, dtype=torch.int32, device=current.device), current[:0]
    breaks = torch.nonzero(changed[1:] != changed[:-1] + 1).flatten() + 1
    first = torch.cat([breaks.new_zeros(1), breaks])
    last = torch.cat([breaks, breaks.new_full((1,), changed.numel())])
    return torch.stack([changed[first], last - first]).to(torch.int32), current[changed]


def apply_delta(span: torch.Tensor, runs: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` into ``span`` at the runs ``encode_delta`` found."""
    if runs.shape[1] == 0:
        return
    starts, lengths = runs[0].long(), runs[1].long()
    run_offsets = torch.cumsum(lengths, 0) - lengths
    index = starts.repeat_interleave(lengths) + torch.arange(values.numel(), device=span.device) \
        - run_offsets.repeat_interleave(lengths)
    span[index] = values


@dataclasses.dataclass(frozen=True)
class SyncStats:
    seconds: float
    bytes: int          # on the wire (headers excluded): what this rank sent or received
    dense_bytes: int    # what a dense sync moves for this rank
    peak_extra_bytes: int
    verified: bool

    @property
    def delta_fraction(self) -> float:
        return self.bytes / self.dense_bytes if self.dense_bytes else 1.0


def _tag(base: int, bucket: int) -> int:
    return base + 4 * bucket


class PoolSender:
    """A training rank's side. ``training``: one flat buffer with ``training_offsets`` (Megatron), or
    ``{name: 1-D tensor}`` (FSDP local shards; the tensors of each sync come with :meth:`send`). Sources in
    another dtype than the plan's are packed in their own dtype and cast per bucket."""

    def __init__(self, plan: CrossPoolPlan, training: torch.Tensor | Mapping[str, torch.Tensor],
                 training_offsets: Mapping[str, int] | None, bridge, verify: bool = True, delta: bool = False):
        if plan.role != TRAINING:
            raise ReshardBindError(f"PoolSender: expected a training rank's plan, found a {plan.role} rank's")
        self.plan, self.bridge, self.verify, self.delta = plan, bridge, verify, delta
        if isinstance(training, torch.Tensor):
            if training_offsets is None:
                raise ReshardBindError("training buffer: expected offsets by parameter name, found None")
            self.source_numels = None
            self.dtype, self.device = training.dtype, training.device
            self._flat = training
            self._packs = [[(None, _program(b.program, training_offsets, None, training.numel(), b.numel,
                                            f"bucket {b.index} pack"))] for b in plan.buckets]
        else:
            if not training:
                raise ReshardBindError("training tensors: expected at least one, found an empty mapping")
            first = next(iter(training.values()))
            self.dtype, self.device = first.dtype, first.device
            self._flat = None
            self.source_numels = {name: t.numel() for name, t in training.items()}
            self._packs = [source_programs(b.program, self.source_numels, None, b.numel, f"bucket {b.index} pack")
                           for b in plan.buckets]
        self.out_dtype = DTYPES[plan.dtype]
        self._previous: dict[int, torch.Tensor] = {}  # bucket index -> last sync's packed bucket (delta)

    def send(self, sources: Mapping[str, torch.Tensor] | None = None, dense: bool = False) -> SyncStats:
        """One sync; ``dense`` sends every span whole even with ``delta`` (the cache is still refreshed)."""
        start = time.perf_counter()
        src = {None: self._flat} if self._flat is not None else dict(sources or {})
        if self._flat is None:
            for name, numel in self.source_numels.items():
                t = src.get(name)
                if t is None or t.numel() != numel or t.dtype != self.dtype:
                    raise ReshardBindError(f"sources[{name!r}]: expected {numel} {self.dtype} elements, found "
                                           f"{'nothing' if t is None else f'{t.numel()} {t.dtype}'}")
        size = self.plan.element_size
        largest = max((b.numel for b in self.plan.buckets), default=0)
        cast = self.dtype != self.out_dtype
        slots = [torch.empty(largest, dtype=self.out_dtype, device=self.device)
                 for _ in range(min(2, len(self._packs)))]
        staging = torch.empty(largest, dtype=self.dtype, device=self.device) if cast else None
        in_flight: list[tuple[list, list]] = [([], []) for _ in slots]
        early: dict[int, tuple[list, list]] = {}  # bucket position -> its header sends posted ahead, their tensors
        sums: dict[int, list[int]] = {}  # peer -> the checksums of its spans, in bucket order
        sent = dense_bytes = 0
        for i, (bucket, packs) in enumerate(zip(self.plan.buckets, self._packs, strict=True)):
            for k in range(i, min(i + _HEADERS_AHEAD, len(self.plan.buckets))):
                if k not in early and not self._encodes(self.plan.buckets[k], dense):
                    early[k] = self._post_dense_headers(self.plan.buckets[k])
            slot = i % len(slots)
            for work in in_flight[slot][0]:  # the slot's previous bucket has left
                work.wait()
            buffer = slots[slot][:bucket.numel]
            if cast:
                for name, program in packs:
                    run_copy_program(src[name], staging[:bucket.numel], program, validate=False)
                buffer.copy_(staging[:bucket.numel])
            else:
                for name, program in packs:
                    run_copy_program(src[name], buffer, program, validate=False)
            works, moved, keep = self._send_bucket(bucket, buffer, dense, early.pop(i, None), sums)
            in_flight[slot] = (works, keep)  # the tensors stay alive until their sends complete
            sent += moved
            dense_bytes += bucket.numel * size
        tables = {peer: torch.tensor(values, dtype=torch.int64) for peer, values in sums.items()}
        finals = [self.bridge.isend_control(table, peer, _SUMS_TAG) for peer, table in tables.items()]
        for works in [w for w, _ in in_flight] + [finals]:
            for work in works:
                work.wait()
        peak = sum(s.numel() for s in slots) * size + (staging.numel() * staging.element_size() if cast else 0)
        return SyncStats(time.perf_counter() - start, sent, dense_bytes, peak, self.verify)

    def _encodes(self, bucket: PoolBucket, dense: bool) -> bool:
        """Whether this sync may send ``bucket`` as a delta (its headers then wait for the encoding)."""
        return self.delta and not dense and bucket.index in self._previous

    def _post_dense_headers(self, bucket: PoolBucket) -> tuple[list, list]:
        headers = [torch.tensor([DENSE, 0, span.numel, int(self.verify)], dtype=torch.int64) for span in bucket.spans]
        return [self.bridge.isend_control(header, span.peer, _tag(_HEADER_TAG, bucket.index))
                for span, header in zip(bucket.spans, headers, strict=True)], headers

    def _send_bucket(self, bucket: PoolBucket, buffer: torch.Tensor, dense: bool, posted: tuple[list, list] | None,
                     sums: dict[int, list[int]]) -> tuple[list, int, list]:
        """Post ``bucket``'s payloads (and its headers unless ``posted`` ahead), then checksum its spans."""
        previous = self._previous.get(bucket.index) if posted is None and self._encodes(bucket, dense) else None
        works, keep = (list(posted[0]), list(posted[1])) if posted is not None else ([], [])
        moved = 0
        for span in bucket.spans:
            data = buffer[span.offset:span.offset + span.numel]
            mode, runs, values = DENSE, None, data
            if previous is not None:
                runs, changed = encode_delta(data, previous[span.offset:span.offset + span.numel])
                if runs.numel() * 4 + changed.numel() * data.element_size() < data.numel() * data.element_size():
                    mode, values = DELTA, changed
            if posted is None:
                header = torch.tensor([mode, 0 if runs is None or mode == DENSE else runs.shape[1], values.numel(),
                                       int(self.verify)], dtype=torch.int64)
                keep.append(header)
                works.append(self.bridge.isend_control(header, span.peer, _tag(_HEADER_TAG, bucket.index)))
            if mode == DELTA and runs.shape[1]:
                runs = runs.contiguous()
                keep.append(runs)
                works.append(self.bridge.isend(runs, span.peer, _tag(_RUNS_TAG, bucket.index)))
                moved += runs.numel() * 4
            if values.numel():
                values = values.contiguous()
                keep.append(values)
                works.append(self.bridge.isend(values, span.peer, _tag(_PAYLOAD_TAG, bucket.index)))
                moved += values.numel() * values.element_size()
        if self.verify:  # off the critical path: the payloads are already posted
            for span in bucket.spans:
                sums.setdefault(span.peer, []).append(checksum(buffer[span.offset:span.offset + span.numel]))
        if self.delta:
            self._previous[bucket.index] = buffer.clone()
        return works, moved, keep

    def forget(self) -> None:
        """Drop the delta cache: the next sync is dense (after the receivers lost their weights)."""
        self._previous.clear()


class PoolReceiver:
    """A rollout rank's side: receives its shard into ``staging`` (a flat buffer in ``rollout_param_specs``
    order); ``live`` (the weights the engine reads, the last sync's) is read only to rebuild delta spans."""

    def __init__(self, plan: CrossPoolPlan, rollout_specs: Sequence[tuple[str, Sequence[int]]], bridge,
                 verify: bool = True):
        if plan.role == TRAINING:
            raise ReshardBindError("PoolReceiver: expected a rollout rank's plan, found a training rank's")
        self.plan, self.bridge, self.verify = plan, bridge, verify
        self.rollout_specs = [(name, tuple(shape)) for name, shape in rollout_specs]
        self.offsets, self.numel = flat_offsets(self.rollout_specs)
        self._unpack, self._inverse = [], []
        for b in plan.buckets:
            self._unpack.append(_program(b.program, None, self.offsets, b.numel, self.numel,
                                         f"bucket {b.index} unpack"))
            rows = [(d, s, r, e, ds, ss) for s, d, r, e, ss, ds in self._unpack[-1].tolist()]
            inverse = make_program(rows)
            validate_program(inverse, self.numel, b.numel)
            self._inverse.append(inverse)

    def zero_padding(self, flat: torch.Tensor) -> None:
        """Vocab-padding rows no bucket writes: zero them once per buffer."""
        for name, offset, numel in self.plan.zero_fill:
            start = self.offsets[name] + offset
            flat[start:start + numel].zero_()

    def receive(self, staging: torch.Tensor, live: torch.Tensor | None = None) -> SyncStats:
        if staging.dim() != 1 or staging.numel() != self.numel or staging.element_size() != self.plan.element_size:
            raise ReshardBindError(f"staging buffer: expected a 1-D {self.plan.dtype} tensor of {self.numel} "
                                   f"elements, found {staging.dtype} shape {tuple(staging.shape)}")
        start = time.perf_counter()
        largest = max((b.numel for b in self.plan.buckets), default=0)
        slots = [torch.empty(largest, dtype=staging.dtype, device=staging.device)
                 for _ in range(min(2, len(self.plan.buckets)))]
        received = dense = 0
        pending = None
        forwards: list[tuple[list, list]] = [([], []) for _ in slots]  # per slot: sends of its bucket onwards
        posted: dict[int, tuple[list, list]] = {}  # bucket position -> (headers, their receives), posted ahead
        got: dict[int, list[tuple[int, int | None]]] = {}  # peer -> (bucket index, checksum here) per checksummed span
        onward: list[int] = []  # the checksums of the buckets forwarded, in bucket order
        for i, bucket in enumerate(self.plan.buckets):
            for k in range(i, min(i + _HEADERS_AHEAD, len(self.plan.buckets))):
                if k not in posted:
                    ahead = self.plan.buckets[k]
                    headers = [torch.empty(_HEADER_LEN, dtype=torch.int64) for _ in ahead.spans]
                    posted[k] = headers, [self.bridge.irecv_control(header, span.peer, _tag(_HEADER_TAG, ahead.index))
                                          for span, header in zip(ahead.spans, headers, strict=True)]
            slot = i % len(slots)
            for work in forwards[slot][0]:  # the slot's previous bucket has been forwarded
                work.wait()
            forwards[slot] = ([], [])
            buffer = slots[slot][:bucket.numel]
            headers, receives = posted.pop(i)
            for work in receives:
                work.wait()
            if any(int(h[0]) == DELTA for h in headers):
                if live is None:
                    raise WeightSyncError(f"bucket {bucket.index}: a delta arrived but this rank has no live "
                                          "weights to apply it to")
                run_copy_program(live, buffer, self._inverse[i], validate=False)
            works, deltas, sums = [], [], []  # sums: the spans whose checksum the sender sends
            for span, header in zip(bucket.spans, headers, strict=True):
                mode, n_runs, n_values, checksummed = (int(v) for v in header)
                data = buffer[span.offset:span.offset + span.numel]
                if mode == DENSE:
                    if n_values != span.numel:
                        raise WeightSyncError(f"bucket {bucket.index} from bridge rank {span.peer} to "
                                              f"{self.plan.rank}: expected {span.numel} elements, header says "
                                              f"{n_values}")
                    works.append(self.bridge.irecv(data, span.peer, _tag(_PAYLOAD_TAG, bucket.index)))
                else:
                    runs = torch.empty(2, n_runs, dtype=torch.int32, device=staging.device)
                    values = torch.empty(n_values, dtype=staging.dtype, device=staging.device)
                    if n_runs:
                        works.append(self.bridge.irecv(runs, span.peer, _tag(_RUNS_TAG, bucket.index)))
                    if n_values:
                        works.append(self.bridge.irecv(values, span.peer, _tag(_PAYLOAD_TAG, bucket.index)))
                    deltas.append((data, runs, values))
                if checksummed:  # drained even when this rank does not verify: the sender waits for it to go
                    sums.append(span)
                elif self.verify:
                    raise WeightSyncError(f"bucket {bucket.index} from bridge rank {span.peer} to {self.plan.rank}: "
                                          "this rank verifies, but the sender sends no checksums (verify differs "
                                          "between the pools)")
                received += (span.numel if mode == DENSE else n_values) * self.plan.element_size + n_runs * 8
                dense += span.numel * self.plan.element_size
            if pending is not None:
                forwards[(i - 1) % len(slots)] = self._finish(*pending, staging, got, onward)
            pending = (i, bucket, buffer, works, deltas, sums)
        if pending is not None:
            forwards[(len(self.plan.buckets) - 1) % len(slots)] = self._finish(*pending, staging, got, onward)
        self._verify(got)
        finals = []
        if onward:  # forwarding: every bucket goes to the same rank of the next replica
            table = torch.tensor(onward, dtype=torch.int64)
            finals.append(self.bridge.isend_control(table, self.plan.buckets[0].forward_to, _SUMS_TAG))
        for sends in [f for f, _ in forwards] + [finals]:
            for work in sends:
                work.wait()
        peak = sum(s.numel() for s in slots) * self.plan.element_size
        return SyncStats(time.perf_counter() - start, received, dense, peak, self.verify)

    def _finish(self, i: int, bucket: PoolBucket, buffer: torch.Tensor, works: list, deltas: list, sums: list,
                staging: torch.Tensor, got: dict, onward: list) -> tuple[list, list]:
        """Wait for bucket ``i``, rebuild its delta spans, checksum them (compared in :meth:`_verify`), unpack;
        forward it whole to the next replica when the plan says so. Returns (the forward's pending sends, the
        tensors they read) (empty when not forwarding)."""
        for work in works:
            work.wait()
        for data, runs, values in deltas:
            apply_delta(data, runs, values)
        for span in sums:
            value = checksum(buffer[span.offset:span.offset + span.numel]) if self.verify else None
            got.setdefault(span.peer, []).append((bucket.index, value))
        forward, keep = [], []
        if bucket.forward_to is not None:  # the unpack and the forward's checksum overlap its transfer
            keep.append(torch.tensor([DENSE, 0, bucket.numel, int(self.verify)], dtype=torch.int64))
            forward = [self.bridge.isend_control(keep[0], bucket.forward_to, _tag(_HEADER_TAG, bucket.index)),
                       self.bridge.isend(buffer, bucket.forward_to, _tag(_PAYLOAD_TAG, bucket.index))]
        run_copy_program(buffer, staging, self._unpack[i], validate=False)
        if forward and self.verify:
            onward.append(checksum(buffer))
        return forward, keep

    def _verify(self, got: dict[int, list[tuple[int, int | None]]]) -> None:
        """Receive every peer's checksum message and compare it with what arrived; the first mismatch (in bucket
        order) is one error naming the bucket and both ranks."""
        tables = {peer: torch.empty(len(spans), dtype=torch.int64) for peer, spans in got.items()}
        for work in [self.bridge.irecv_control(table, peer, _SUMS_TAG) for peer, table in tables.items()]:
            work.wait()
        if not self.verify:
            return
        checks = sorted((index, peer, value, int(sent)) for peer, spans in got.items()
                        for (index, value), sent in zip(spans, tables[peer].tolist(), strict=True))
        for index, peer, value, sent in checks:
            if value != sent:
                raise WeightSyncError(
                    f"weight sync: bucket {index} from training rank {peer} to rollout rank {self.plan.rank} "
                    f"(replica {self.plan.replica}, tp rank {self.plan.rollout_tp_rank}): checksum mismatch (sent "
                    f"{sent & (2**64 - 1):#018x}, received {value & (2**64 - 1):#018x})")
