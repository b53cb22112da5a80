"""Adapter-only weight sync (LoRA) through the 3D-HybridEngine: after the first sync, only the adapters move.

The first sync of a LoRA actor with ``lora.merge=false`` sends the frozen base ``W0`` through today's dense reshard
(colocated: :class:`~verl.hybrid_engine.executor.ReshardExecutor`; standalone pool:
:mod:`~verl.hybrid_engine.weight_sync`). Every sync then moves the adapters alone, planned by the same planner over
*adapter layouts* (layouts as data, :mod:`layouts`): the logical tensors are the HF adapter tensors
``<module>.lora_A.weight`` [r, in] and ``<module>.lora_B.weight`` [out, r], and

* training (:class:`AdapterTrainingLayout`), Megatron: a column-parallel linear's ``B`` is placed exactly as its
  ``W`` (Shard(0), the QKV per-group interleave, the gate/up halves) and its ``A`` replicated; a row-parallel
  linear's ``A`` is Shard(1) like its ``W`` and its ``B`` replicated; a fused linear (``linear_qkv``,
  ``linear_fc1``) has one ``A`` for all its parts (named after the first of its HF parts: the query's, the gate's).
  FSDP (PEFT): every factor ``ChunkShard(0)`` under its PEFT name (``A`` split over r).
* rollout (:class:`AdapterRolloutLayout`): per rollout linear, ``B`` of each adapted part placed as that part's
  rows of the rollout weight (Shard(0), KV heads replicated past their count), ``A`` replicated; a row-parallel
  linear's ``A`` Shard(1) and ``B`` replicated. So on every rollout rank ``W_local[piece] = W0_local[piece] +
  (alpha/r) B_local A_local`` is exactly that rank's rows/columns of the merged weight.

Each rollout rank applies the adapter shard it received to its own rollout-layout shard
(:class:`AdapterApplier`): merged in place, ``W = W0 + (alpha/r) B A`` computed in fp32 from a kept copy of the
base shard (``W0`` is never overwritten, so merges do not accumulate rounding), the other tensors restored from
that copy when the engine dropped its buffer (the native engine frees it after every generation; SGLang's push
buffer is merged before the push). The adapters travel in fp32 (the trainer's merge precision; ``A``/``B`` are
fp32 or bf16 parameters, so the cast is lossless).

Integrity (issue 45 item 4): the checksum of the adapter buffer a rollout rank applies is compared with what the
senders sent. The checksum (:func:`~verl.hybrid_engine.weight_sync.checksum`, a position-weighted word sum mod
2^64) is linear over disjoint parts, so every sender computes, from its own training tensors and the plan, the
contribution of each rectangle it sends to the checksum of the receiver's buffer at the rectangle's final
position (:func:`sender_digests`); their sum is the expected checksum of each receiver's adapter buffer. A
mismatch raises :class:`LoRASyncError`; so does a sync that delivered nothing new while the trainer's adapter
changed (verl #7495: the base pushed every step, the adapter never arriving) -- compared through a fingerprint of
the live adapter parameters that is not read from what was sent.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from verl.hybrid_engine.layouts import (
    AnyTrainingLayout,
    ChunkShard,
    LayoutError,
    ParamLayout,
    Replicate,
    Shard,
    as_matrix,
    hf_tensor_shapes,
    local_pieces,
    local_shape,
)
from verl.hybrid_engine.rollout_layout import RolloutLayout, check_rollout_tp, rollout_param_specs
from verl.models.config import ModelConfig

# The adapters move in fp32 whatever the rollout dtype: the merge is computed in fp32 from them.
ADAPTER_DTYPE = "float32"
METRIC_ADAPTER_BYTES = "perf/lora_sync_bytes"
METRIC_BASE_BYTES = "perf/lora_base_sync_bytes"
METRIC_MERGE_SECONDS = "timing_s/lora_merge"
METRIC_BASE_COPY_MB = "perf/lora_base_copy_mb"


class LoRASyncError(RuntimeError):
    """An adapter sync whose result is not what the trainer sent, or that delivered nothing new while the adapter
    changed (an internal error: never the user's input)."""


def adapter_a(module_weight: str) -> str:
    """The HF adapter name of ``A`` for an HF weight (``<module>.weight`` -> ``<module>.lora_A.weight``)."""
    return module_weight.removesuffix(".weight") + ".lora_A.weight"


def adapter_b(module_weight: str) -> str:
    return module_weight.removesuffix(".weight") + ".lora_B.weight"


def peft_name(adapter: str) -> str:
    """PEFT's in-model name of an HF adapter tensor (``...lora_A.weight`` -> ``...lora_A.default.weight``)."""
    return adapter.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight",
                                                                               ".lora_B.default.weight")


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """What is adapted: the HF weights (``modules``, ``.weight`` names in HF order), the rank, the scale
    ``alpha / r``, and whether a fused linear shares one ``A`` (Megatron) or each HF module has its own (PEFT)."""

    rank: int
    scale: float
    modules: tuple[str, ...]
    shared_a: bool

    def __post_init__(self):
        if self.rank <= 0 or not self.modules:
            raise LayoutError(f"LoRA sync: expected a positive rank and adapted modules, found rank {self.rank} and "
                              f"{len(self.modules)} modules")

    def fused_groups(self, config: ModelConfig) -> list[tuple[str, ...]]:
        """The parts of every rollout linear that holds adapted modules (one group per linear)."""
        adapted = set(self.modules)
        return [p.parts for p in RolloutLayout(1).params(config) if any(m in adapted for m in p.parts)]

    def shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The logical adapter tensors and their shapes (a fused linear's shared ``A`` under its first part)."""
        hf = hf_tensor_shapes(config)
        missing = [m for m in self.modules if m not in hf or len(hf[m]) != 2]
        if missing:
            raise LayoutError(f"LoRA sync: expected 2-D HF weights of the model, found {missing[:3]}")
        out: dict[str, tuple[int, ...]] = {}
        adapted = set(self.modules)
        for parts in self.fused_groups(config):
            if self.shared_a and not all(m in adapted for m in parts):
                raise LayoutError(f"LoRA sync: a fused linear shares one A, expected all of {parts} adapted")
            for i, m in enumerate(parts):
                if m not in adapted:
                    continue
                out_rows, in_cols = hf[m]
                if i == 0 or not self.shared_a:
                    out[adapter_a(m)] = (self.rank, in_cols)
                out[adapter_b(m)] = (out_rows, self.rank)
        return out

    def a_of(self, parts: Sequence[str], part: str) -> str:
        return adapter_a(parts[0] if self.shared_a else part)


def _is_row(placement) -> bool:
    return isinstance(placement, Shard | ChunkShard) and placement.dim == 1


@dataclasses.dataclass(frozen=True)
class AdapterTrainingLayout:
    """The adapters of a training layout (Megatron's or FSDP's ``base``) as a layout the planner plans: it answers
    what the base answers about ranks and groups, and places the adapter tensors (see the module docstring)."""

    base: AnyTrainingLayout
    spec: AdapterSpec
    # True: every factor is one parameter under its PEFT name, split on dim 0 like every parameter of a fully
    # sharded engine (one stage). False: the factors follow their base linear's TP placement (A of a row linear
    # split on columns, B of a column linear on rows), on the base's stages.
    flat_shards: bool = False

    # -- what the groups and the planner ask of a training layout: the base's answers
    tp = property(lambda self: self.base.tp)
    pp = property(lambda self: self.base.pp)
    dp = property(lambda self: self.base.dp)
    ep = property(lambda self: self.base.ep)
    expert_tp = property(lambda self: getattr(self.base, "expert_tp", self.base.tp))
    etp = property(lambda self: getattr(self.base, "etp", None))

    @property
    def world_size(self) -> int:
        return self.base.world_size

    def coords(self, rank: int) -> tuple[int, int, int]:
        return self.base.coords(rank)

    def expert_coords(self, rank: int) -> tuple[int, int, int]:
        return self.base.expert_coords(rank)

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return self.base.rank(pp_rank, dp_rank, tp_rank)

    def check(self, config: ModelConfig) -> None:
        self.base.check(config)

    def gathers_in_place(self, rollout_tp: int) -> bool:
        return self.base.gathers_in_place(rollout_tp)

    def reshard_reason(self, rollout_tp: int) -> str:
        return "adapters only: " + self.base.reshard_reason(rollout_tp)

    def received_bound(self, *args):
        return self.base.received_bound(*args)

    def describe(self) -> str:
        return f"{self.base.describe()} adapters r={self.spec.rank}"

    # -- the adapter tensors
    def tensor_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return self.spec.shapes(config)

    def rollout_layout(self, rollout_tp: int) -> AdapterRolloutLayout:
        return AdapterRolloutLayout(rollout_tp, self.spec)

    def params(self, config: ModelConfig, pp_rank: int = 0, ep_rank: int = 0) -> list[ParamLayout]:
        """The adapter parameters stage ``pp_rank`` holds, by the training engine's own names."""
        spec, adapted = self.spec, set(self.spec.modules)
        if self.flat_shards:
            if pp_rank:
                raise LayoutError(f"pp rank: expected 0 (a fully sharded engine has one stage), found {pp_rank}")
            out = []
            for name in spec.shapes(config):
                out.append(ParamLayout(peft_name(name), (name,), ChunkShard(0)))
            return out
        out = []
        for p in self.base.params(config, pp_rank, ep_rank):
            if not p.parts or not all(m in adapted for m in p.parts):
                continue
            if p.expert:
                raise LayoutError(f"LoRA sync: {p.name} is an expert's linear; adapters on experts are not "
                                  "implemented")
            stem = p.name.removesuffix("weight")
            row = _is_row(p.part_placement(0))
            out.append(ParamLayout(stem + "lora_A.weight", (adapter_a(p.parts[0]),),
                                   Shard(1) if row else Replicate(), p.stages))
            out.append(ParamLayout(stem + "lora_B.weight", tuple(adapter_b(m) for m in p.parts),
                                   Replicate() if row else p.tp, p.stages, groups=p.groups))
        return out


@dataclasses.dataclass(frozen=True)
class AdapterRolloutLayout:
    """The adapters of the rollout layout (``t_g`` = ``tp``), in the adapter buffer's order."""

    tp: int
    spec: AdapterSpec

    def params(self, config: ModelConfig) -> list[ParamLayout]:
        check_rollout_tp(config, self.tp)
        adapted, spec = set(self.spec.modules), self.spec
        out = []
        for p in RolloutLayout(self.tp).params(config):
            parts = [m for m in p.parts if m in adapted]
            if not parts:
                continue
            row = _is_row(p.part_placement(0))
            a_placement = Shard(1) if row else Replicate()
            if spec.shared_a:
                out.append(ParamLayout(p.name.removesuffix(".weight") + ".lora_A.weight", (adapter_a(p.parts[0]),),
                                       a_placement))
            for i, m in enumerate(p.parts):
                if m not in adapted:
                    continue
                if not spec.shared_a:
                    out.append(ParamLayout(adapter_a(m), (adapter_a(m),), a_placement))
                out.append(ParamLayout(adapter_b(m), (adapter_b(m),), Replicate() if row else p.part_placement(i)))
        return out

    def specs(self, config: ModelConfig, tp_rank: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, local shape) of rollout rank ``tp_rank``'s adapter tensors, in buffer order."""
        shapes = self.spec.shapes(config)
        return [(p.name, local_shape(p, shapes, self.tp, tp_rank)) for p in self.params(config)]


def adapter_rollout_specs(config: ModelConfig, spec: AdapterSpec, rollout_tp: int,
                          tp_rank: int) -> list[tuple[str, tuple[int, ...]]]:
    return AdapterRolloutLayout(rollout_tp, spec).specs(config, tp_rank)


# ------------------------------------------------------------------------------------------------
# The rollout side: merge the received adapter shard into the rollout shard, from a kept base
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Merge:
    span: tuple[int, int]  # (start, numel) in the rollout flat buffer: rows x cols of W
    rows: int
    cols: int
    a: tuple[int, int, int]  # (offset, rows, cols) in the adapter buffer
    b: tuple[int, int, int]


class AdapterApplier:
    """Rollout rank ``tp_rank``'s merge of its adapter shard into its rollout shard.

    ``capture(flat)`` keeps a copy of the base shard ``W0`` (the first sync's dense weights; the memory cost of
    this path: one rollout shard, on the rollout buffer's device); ``apply(flat, adapters)`` writes every adapted
    piece as ``W0 + scale * B @ A`` (one fp32 ``addmm``, cast once to the rollout dtype) and, with ``restore``,
    every other element from ``W0`` (a buffer the engine released and reacquired holds nothing)."""

    def __init__(self, config: ModelConfig, spec: AdapterSpec, rollout_tp: int, tp_rank: int):
        from verl.hybrid_engine.executor import flat_offsets

        self.spec = spec
        base_specs = [(s.name, tuple(s.shape)) for s in rollout_param_specs(config, rollout_tp, tp_rank)]
        w_offsets, self.numel = flat_offsets(base_specs)
        adapter_specs = adapter_rollout_specs(config, spec, rollout_tp, tp_rank)
        a_offsets, self.adapter_numel = flat_offsets(adapter_specs)
        a_shapes = dict(adapter_specs)
        shapes = hf_tensor_shapes(config)
        adapted = set(spec.modules)
        merges: list[_Merge] = []
        for p in RolloutLayout(rollout_tp).params(config):
            if not any(m in adapted for m in p.parts):
                continue
            (w_rows, w_cols), pieces = local_pieces(p, shapes, rollout_tp, tp_rank)
            a_name = (p.name.removesuffix(".weight") + ".lora_A.weight") if spec.shared_a else None
            for part in p.parts:
                if part not in adapted:
                    continue
                mine = [q for q in pieces if q.tensor == part]
                if len(mine) != 1 or mine[0].local_col or mine[0].cols != w_cols:
                    raise LayoutError(f"LoRA sync: {p.name}: expected one full-width piece of {part} on rollout rank "
                                      f"{tp_rank}, found {mine}")
                q = mine[0]
                a = a_name or adapter_a(part)
                a_shape, b_shape = as_matrix(a_shapes[a]), as_matrix(a_shapes[adapter_b(part)])
                if b_shape != (q.rows, spec.rank) or a_shape != (spec.rank, q.cols):
                    raise LayoutError(f"LoRA sync: {part}: expected B {(q.rows, spec.rank)} and A "
                                      f"{(spec.rank, q.cols)} on rollout rank {tp_rank}, found {b_shape} and {a_shape}")
                start = w_offsets[p.name] + q.local_row * w_cols
                merges.append(_Merge((start, q.rows * q.cols), q.rows, q.cols, (a_offsets[a], *a_shape),
                                     (a_offsets[adapter_b(part)], *b_shape)))
        self.merges = sorted(merges, key=lambda m: m.span[0])
        rest, cursor = [], 0
        for m in self.merges:
            if m.span[0] > cursor:
                rest.append((cursor, m.span[0] - cursor))
            cursor = max(cursor, m.span[0] + m.span[1])
        if cursor < self.numel:
            rest.append((cursor, self.numel - cursor))
        self.rest = rest
        self.base: torch.Tensor | None = None

    @property
    def merged_elems(self) -> int:
        return sum(m.span[1] for m in self.merges)

    def capture(self, flat: torch.Tensor) -> None:
        """Keep ``flat`` (this rank's rollout shard of the base, just synced) as ``W0``."""
        if flat.numel() != self.numel:
            raise LayoutError(f"LoRA sync: expected a rollout shard of {self.numel} elements, found {flat.numel()}")
        self.base = flat.detach().clone()

    @property
    def base_bytes(self) -> int:
        return 0 if self.base is None else self.base.numel() * self.base.element_size()

    def apply(self, flat: torch.Tensor, adapters: torch.Tensor, restore: bool) -> None:
        if self.base is None:
            raise LoRASyncError("LoRA sync: expected the base shard from a first dense sync, found none")
        if adapters.numel() != self.adapter_numel or flat.numel() != self.numel:
            raise LayoutError(f"LoRA sync: expected buffers of {self.numel} and {self.adapter_numel} elements, found "
                              f"{flat.numel()} and {adapters.numel()}")
        with torch.no_grad():
            if restore:
                for start, numel in self.rest:
                    flat[start:start + numel].copy_(self.base[start:start + numel])
            for m in self.merges:
                start, numel = m.span
                a = adapters[m.a[0]:m.a[0] + m.a[1] * m.a[2]].view(m.a[1], m.a[2]).float()
                b = adapters[m.b[0]:m.b[0] + m.b[1] * m.b[2]].view(m.b[1], m.b[2]).float()
                w0 = self.base[start:start + numel].view(m.rows, m.cols).float()
                flat[start:start + numel].view(m.rows, m.cols).copy_(torch.addmm(w0, b, a, alpha=self.spec.scale))


def merged_oracle(config: ModelConfig, spec: AdapterSpec, base: Mapping[str, torch.Tensor],
                  adapters: Mapping[str, torch.Tensor], rollout_tp: int, tp_rank: int,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rollout rank ``tp_rank``'s shard of the merged model, cut from full HF tensors: every adapted HF weight
    ``W0 + scale * B @ A`` (pure torch, fp32), then sliced by the rollout layout (what the tests compare with)."""
    from verl.hybrid_engine.layouts import fill_local

    adapted = set(spec.modules)
    groups = {m: parts for parts in spec.fused_groups(config) for m in parts}
    merged = {}
    for name, w in base.items():
        if name in adapted:
            a = adapters[spec.a_of(groups[name], name)].float()
            merged[name] = (w.float() + spec.scale * (adapters[adapter_b(name)].float() @ a)).to(dtype)
        else:
            merged[name] = w.to(dtype)
    shapes = hf_tensor_shapes(config)
    out = {}
    for p, s in zip(RolloutLayout(rollout_tp).params(config), rollout_param_specs(config, rollout_tp, tp_rank),
                    strict=True):
        out[s.name] = torch.empty(s.shape, dtype=dtype)
        fill_local(p, shapes, rollout_tp, tp_rank, out[s.name], merged.__getitem__)
    return out


# ------------------------------------------------------------------------------------------------
# Checksums: what each receiver's adapter buffer must sum to, from the senders' tensors
# ------------------------------------------------------------------------------------------------

_MASK = (1 << 64) - 1
_WORDS = {2: (torch.int16, 0xFFFF), 4: (torch.int32, 0xFFFFFFFF), 8: (torch.int64, None)}


def transfer_digest(source: torch.Tensor, tr, dst_base: int) -> int:
    """The contribution of transfer ``tr`` (a planner ``_Transfer`` read from the 1-D ``source``) to the
    checksum of the receiving buffer, ``dst_base`` being its rollout parameter's offset there: sum over its
    elements of word * (2 * final position + 1), mod 2^64 (:func:`weight_sync.checksum`, regrouped by rows)."""
    word, mask = _WORDS[source.element_size()]
    block = source.as_strided((tr.rows, tr.cols), (tr.src_stride, 1),
                              source.storage_offset() + tr.src_row * tr.src_stride + tr.src_col)
    words = block.view(word).to(torch.int64)
    if mask is not None:
        words = words & mask
    s0 = words.sum(dim=1)
    s1 = (words * torch.arange(tr.cols, dtype=torch.int64, device=words.device)).sum(dim=1)
    starts = dst_base + (tr.dst_row + torch.arange(tr.rows, dtype=torch.int64, device=words.device)) * tr.dst_stride \
        + tr.dst_col
    return int(((2 * starts + 1) * s0 + 2 * s1).sum()) & _MASK


def buffer_checksum(flat: torch.Tensor) -> int:
    from verl.hybrid_engine.weight_sync import checksum

    return checksum(flat) & _MASK


def as_int64(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def colocated_digests(config: ModelConfig, training: AdapterTrainingLayout, rollout_tp: int, bucket_bytes: int,
                      rank: int, sources: Mapping[str, torch.Tensor], dst_offsets: Mapping[str, int]) -> list[int]:
    """This rank's contribution to the checksum of every rank's adapter buffer (index = global rank) under the
    colocated plan (the global assignment ``plan_reshard`` derives every rank's plan from)."""
    from verl.hybrid_engine.groups import HYBRIDFLOW
    from verl.hybrid_engine.planner import _global_plan
    from verl.utils.torch_dtypes import ELEMENT_SIZES

    g = _global_plan(config, training, AdapterRolloutLayout(rollout_tp, training.spec),
                     bucket_bytes // ELEMENT_SIZES[ADAPTER_DTYPE])
    out = [0] * training.world_size

    def add(tr, ranks):
        value = transfer_digest(sources[tr.src_param], tr, dst_offsets[tr.dst_param])
        for r in ranks:
            out[r] = (out[r] + value) & _MASK

    if g.groups.case == HYBRIDFLOW:
        group = g.groups.micro_dp_group_of(rank)
        for chunks in g.gather_chunks.get(group, ()):
            for tr in chunks[group.index(rank)]:
                add(tr, group)
    for routes in g.a2a_buckets:
        for route in routes:
            if route.src == rank:
                add(route.transfer, (route.dst,))
    for tr in g.local[rank]:
        add(tr, (rank,))
    return out


def pool_digests(config: ModelConfig, placement, bucket_bytes: int, rank: int, sources: Mapping[str, torch.Tensor],
                 dst_offsets_of: Callable[[int], Mapping[str, int]]) -> list[int]:
    """A training rank's contribution to the checksum of every rollout rank's adapter buffer (index = bridge rank
    - N_t) under the cross-pool plan; with forwarding, replica k > 0 gets replica 0's (the same buffer)."""
    from verl.hybrid_engine.cross_pool import _global_pool_plan
    from verl.utils.torch_dtypes import ELEMENT_SIZES

    g = _global_pool_plan(config, placement, bucket_bytes // ELEMENT_SIZES[ADAPTER_DTYPE])
    tg, n = placement.rollout_tp, placement.n_training
    out = [0] * placement.n_rollout
    for routes in g.buckets:
        for route in routes:
            if route.src != rank:
                continue
            j = (route.dst - n) % tg
            value = transfer_digest(sources[route.transfer.src_param], route.transfer,
                                    dst_offsets_of(j)[route.transfer.dst_param])
            targets = [k * tg + j for k in range(placement.replicas)] if placement.forward else [route.dst - n]
            for t in targets:
                out[t] = (out[t] + value) & _MASK
    return out


def sum_digests(gathered: Sequence[Sequence[int]]) -> list[int]:
    return [sum(int(row[i]) for row in gathered) & _MASK for i in range(len(gathered[0]))]


class SyncGuard:
    """The rollout side's two checks of every adapter sync: the applied adapter's checksum equals the senders'
    (``expected``), and a sync while the trainer's adapter changed (``changed``) delivered something new."""

    def __init__(self, where: str):
        self.where = where
        self.applied: int | None = None

    def check(self, applied: int, expected: int, changed: bool | None, any_new: bool | None = None) -> None:
        if applied != expected:
            raise LoRASyncError(f"LoRA sync: {self.where}: the adapter applied has checksum {applied:#018x}, the "
                                f"senders sent {expected:#018x}")
        new = self.applied is None or applied != self.applied if any_new is None else any_new
        if changed and not new:
            raise LoRASyncError(f"LoRA sync: {self.where}: the trainer's adapter changed since the last sync, but "
                                "the sync delivered nothing new (the rollout serves the old adapter; verl #7495)")
        self.applied = applied


class LoRASyncSource:
    """What a training engine hands the adapter-only sync (``TrainingEngine.lora_sync_source``): ``spec`` and
    ``training`` (the adapters as an :class:`AdapterTrainingLayout`), the frozen base by name (``base_sources``,
    sent once) and this rank's live adapter tensors (``adapter_params``); the adapters as sent and their fingerprint
    follow from those."""

    spec: AdapterSpec
    training: AdapterTrainingLayout

    def base_sources(self, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def adapter_params(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def adapter_sources(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Every adapter tensor by name, float32 and 1-D on ``device`` (what the sync sends)."""
        with torch.no_grad():
            return {name: t.detach().to(device=device, dtype=torch.float32).contiguous().reshape(-1)
                    for name, t in self.adapter_params().items()}

    def fingerprint(self) -> int:
        return live_fingerprint(self.adapter_params())


def live_fingerprint(params: Mapping[str, torch.Tensor]) -> int:
    """A fingerprint of this rank's live adapter parameters (their own dtype and storage, not what is sent)."""
    from verl.hybrid_engine.weight_sync import checksum

    value = 0
    for k, name in enumerate(sorted(params)):
        t = params[name].detach()
        if t.numel():
            value = (value + (checksum(t.contiguous().reshape(-1)) & _MASK) * (2 * k + 1)) & _MASK
    return value


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------
# Colocated (the hybrid engine's transition)
# ------------------------------------------------------------------------------------------------

class ColocatedLoRASync:
    """The adapter half of a colocated LoRA transition on this rank: reshard the adapters (their own plan, same
    groups) into a small adapter buffer, prove it against the senders' digests, merge it into the rollout shard.

    ``source``: the training engine's ``lora_sync_source`` (``spec``, ``training``, ``adapter_sources(device)``,
    ``fingerprint()``)."""

    def __init__(self, source, config: ModelConfig, rollout_tp: int, bucket_bytes: int, groups, process_groups):
        import torch.distributed as dist

        from verl.hybrid_engine.executor import flat_offsets
        from verl.hybrid_engine.planner import plan_reshard

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.source, self.config = source, config
        self.rollout_tp, self.bucket_bytes = rollout_tp, bucket_bytes
        rollout = AdapterRolloutLayout(rollout_tp, source.spec)
        self.plan = plan_reshard(config, source.training, rollout, self.rank, bucket_bytes, ADAPTER_DTYPE)
        j = groups.rollout_tp_rank[self.rank]
        self.specs = rollout.specs(config, j)
        self.offsets, _ = flat_offsets(self.specs)
        self.process_groups = process_groups
        self.executor = None
        self.applier = AdapterApplier(config, source.spec, rollout_tp, j)
        self.guard = SyncGuard(f"rank {self.rank} (rollout tp rank {j})")
        self._fingerprint: int | None = None

    @property
    def has_base(self) -> bool:
        return self.applier.base is not None

    def capture_base(self, flat: torch.Tensor) -> None:
        self.applier.capture(flat)

    def sync(self, flat: torch.Tensor, restore: bool) -> dict[str, float]:
        """Adapters into ``flat`` (the rollout shard; ``restore``: it holds nothing since the last sync)."""
        import torch.distributed as dist

        from verl.hybrid_engine.executor import ReshardExecutor

        start = time.perf_counter()
        sources = self.source.adapter_sources(flat.device)
        if self.executor is None:
            self.executor = ReshardExecutor(self.plan, sources, None, self.specs, self.process_groups)
        stats = self.executor.to_rollout(sources=sources)
        adapters = self.executor.rollout_flat
        digests = colocated_digests(self.config, self.source.training, self.rollout_tp, self.bucket_bytes, self.rank,
                                    sources, self.offsets)
        del sources
        fingerprint = self.source.fingerprint()
        changed = self._fingerprint is not None and fingerprint != self._fingerprint
        applied = buffer_checksum(adapters)
        new = self.guard.applied is None or applied != self.guard.applied
        row = torch.tensor([as_int64(d) for d in digests] + [int(changed), int(new)], dtype=torch.int64,
                           device=flat.device)
        if self.world > 1:
            gathered = [torch.empty_like(row) for _ in range(self.world)]
            dist.all_gather(gathered, row)
            rows = [g.tolist() for g in gathered]
        else:
            rows = [row.tolist()]
        expected = sum_digests([r[:self.world] for r in rows])[self.rank]
        self.guard.check(applied, expected, any(r[self.world] for r in rows), any(r[self.world + 1] for r in rows))
        self._fingerprint = fingerprint
        merge = time.perf_counter()
        self.applier.apply(flat, adapters, restore)
        end = time.perf_counter()
        return {METRIC_ADAPTER_BYTES: float(self.plan.bytes_received), METRIC_MERGE_SECONDS: end - merge,
                "timing_s/lora_sync": end - start, METRIC_BASE_COPY_MB: self.applier.base_bytes / 2**20,
                "_seconds": stats.seconds}

    def release(self) -> None:
        if self.executor is not None:
            self.executor.release()


# ------------------------------------------------------------------------------------------------
# Standalone pool (cross-pool plan over the bridge; checksummed spans as the dense sync's)
# ------------------------------------------------------------------------------------------------

class PoolLoRASender:
    """A training rank's adapter half of a pool sync. :meth:`prepare` (collective over the training ranks) reads
    the adapters and agrees on what every rollout rank must end up with (``expected``: the checksum of each rollout
    rank's adapter buffer, which rank 0 sends with the sync command); it refuses a sync that would deliver nothing
    new while the live adapter changed. :meth:`send` moves them (every span checksummed in its header)."""

    def __init__(self, source, config: ModelConfig, placement, rank: int, bucket_bytes: int, bridge,
                 verify: bool = True, group=None):
        from verl.hybrid_engine.cross_pool import PoolPlacement, plan_cross_pool
        from verl.hybrid_engine.executor import flat_offsets

        self.source, self.config, self.rank, self.bucket_bytes = source, config, rank, bucket_bytes
        self.placement = PoolPlacement(source.training, placement.rollout_tp, placement.replicas)
        self.plan = plan_cross_pool(config, self.placement, rank, bucket_bytes, ADAPTER_DTYPE)
        self.bridge, self.verify = bridge, verify
        self.group = group  # the training ranks' process group (None: the default one, as in the trainer)
        self._offsets = [flat_offsets(adapter_rollout_specs(config, source.spec, placement.rollout_tp, j))[0]
                         for j in range(placement.rollout_tp)]
        self.sender = None
        self._fingerprint: int | None = None
        self._expected: list[int] | None = None

    def prepare(self, device: torch.device | str) -> tuple[dict[str, torch.Tensor], dict]:
        import torch.distributed as dist

        sources = self.source.adapter_sources(device)
        digests = pool_digests(self.config, self.placement, self.bucket_bytes, self.rank, sources,
                               self._offsets.__getitem__)
        fingerprint = self.source.fingerprint()
        changed = self._fingerprint is not None and fingerprint != self._fingerprint
        row = torch.tensor([as_int64(d) for d in digests] + [int(changed)], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            gathered = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(gathered, row, group=self.group)
            rows = [g.tolist() for g in gathered]
        else:
            rows = [row.tolist()]
        n = self.placement.n_rollout
        expected = sum_digests([r[:n] for r in rows])
        any_changed = any(r[n] for r in rows)
        if any_changed and expected == self._expected:
            raise LoRASyncError(f"LoRA sync: training rank {self.rank}: the trainer's adapter changed since the last "
                                "sync, but the adapters about to be sent are the last sync's (the pool would serve "
                                "the old adapter; verl #7495)")
        self._fingerprint, self._expected = fingerprint, expected
        return sources, {"expected": expected, "changed": any_changed}

    def send(self, sources: Mapping[str, torch.Tensor]):
        from verl.hybrid_engine.weight_sync import PoolSender

        if self.sender is None:
            self.sender = PoolSender(self.plan, sources, None, self.bridge, verify=self.verify, delta=False)
        return self.sender.send(sources)


class PoolLoRAReceiver:
    """A rollout rank's adapter half of a pool sync: receive its adapter shard (spans verified against their
    headers), prove the buffer it applies against the training side's ``expected`` checksum, merge it into the
    target rollout buffer from the base kept at the first sync."""

    def __init__(self, config: ModelConfig, placement, rank: int, bucket_bytes: int, bridge, verify: bool = True,
                 device: torch.device | str = "cpu"):
        from verl.hybrid_engine.cross_pool import ROLLOUT, plan_cross_pool
        from verl.hybrid_engine.weight_sync import PoolReceiver

        spec = placement.training.spec
        role, replica, tp_rank = placement.role(rank)
        if role != ROLLOUT:
            raise LayoutError(f"LoRA sync: expected a rollout pool rank, found bridge rank {rank} ({role})")
        self.plan = plan_cross_pool(config, placement, rank, bucket_bytes, ADAPTER_DTYPE)
        specs = adapter_rollout_specs(config, spec, placement.rollout_tp, tp_rank)
        self.receiver = PoolReceiver(self.plan, specs, bridge, verify=verify)
        self.applier = AdapterApplier(config, spec, placement.rollout_tp, tp_rank)
        self.adapters = torch.empty(self.applier.adapter_numel, dtype=torch.float32, device=device)
        self.index = rank - placement.n_training
        self.guard = SyncGuard(f"rollout pool rank {self.index} (replica {replica}, tp rank {tp_rank})")

    def capture_base(self, flat: torch.Tensor) -> None:
        self.applier.capture(flat)

    def receive(self, target: torch.Tensor, restore: bool, info: Mapping) -> dict[str, float]:
        start = time.perf_counter()
        stats = self.receiver.receive(self.adapters)
        applied = buffer_checksum(self.adapters)
        # The training side refused "nothing new" already (it holds the live fingerprint); here: the proof.
        self.guard.check(applied, int(info["expected"][self.index]) & _MASK, False)
        merge = time.perf_counter()
        self.applier.apply(target, self.adapters, restore)
        return {METRIC_ADAPTER_BYTES: float(stats.bytes), METRIC_MERGE_SECONDS: time.perf_counter() - merge,
                "timing_s/lora_sync": time.perf_counter() - start}
