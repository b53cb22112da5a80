"""Layouts as data: where every element of every weight lives, for training and for rollout.

A model's *logical* tensors are its unfused HF weights, as the architecture's model spec
(``verl.models.spec``) names them. An engine's *local* parameter is one or more logical tensors
placed on a mesh and fused:

* ``tp`` placement, DTensor-style: :class:`Shard` (``dim``; ``replicas`` consecutive ranks may hold
  the same chunk, as SGLang does for KV heads), :class:`ChunkShard` (torch.chunk's uneven split, as
  FSDP2 shards) or :class:`Replicate`;
* ``stages``: the pipeline stages that hold it;
* fusion: the parts are stacked on dim 0, interleaved in ``groups`` row groups (Megatron's
  ``linear_qkv`` is ``num_query_groups`` groups of ``[q heads; k; v]``), and a vocab table is padded
  to ``padded_rows`` before it is sharded.

:func:`local_pieces` turns one :class:`ParamLayout` on one tp rank into rectangles
(:class:`Piece`): "local rows/cols here hold logical rows/cols there". The reshard planner works only
on these rectangles, so every fused format is handled by the same code; :func:`fill_local` cuts a
local parameter out of its full logical tensors with them (a checkpoint load, a reference).

This module also holds the two training layouts, both derived from the model spec: Megatron's
(megatron-core GPTModel built with ``get_gpt_layer_local_spec``) and FSDP2's (``fully_shard`` on a
transformers model); the SGLang rollout layout is in :mod:`rollout_layout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from verl.errors import InputError
from verl.models.config import ModelConfig
from verl.models.mcore.model import padded_vocab_size
from verl.models.spec.base import TP, Fusion
from verl.models.spec.registry import model_spec


class LayoutError(InputError):
    """A parallel layout the model cannot be split over."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """Split on ``dim`` into ``mesh_size / replicas`` chunks; ranks ``[c*replicas, (c+1)*replicas)``
    hold chunk ``c`` (``replicas > 1`` only when there are fewer chunks than ranks)."""

    dim: int
    replicas: int = 1

    def __repr__(self) -> str:
        return f"Shard({self.dim})" if self.replicas == 1 else f"Shard({self.dim}, replicas={self.replicas})"


@dataclasses.dataclass(frozen=True)
class ChunkShard:
    """Split on ``dim`` as ``torch.chunk`` (and FSDP2's ``Shard(0)``) does: chunks of ceil(n / mesh_size),
    so the last ranks may hold fewer rows, or none."""

    dim: int

    def __repr__(self) -> str:
        return f"ChunkShard({self.dim})"


@dataclasses.dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "Replicate()"


Placement = Shard | ChunkShard | Replicate


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One local parameter of an engine: which logical tensors it fuses and how they are placed."""

    name: str                  # the engine's own name (Megatron state-dict key or SGLang param name)
    parts: tuple[str, ...]     # logical HF tensors stacked on dim 0, in this order
    tp: Placement | tuple[Placement, ...]  # over the tp mesh dim: one for all parts, or one per part
    stages: tuple[int, ...] = (0,)
    groups: int = 1            # rows of all parts interleave in this many groups (global count)
    padded_rows: int | None = None  # vocab tables: rows after padding, before sharding
    expert: bool = False       # a training expert parameter: placed over the expert layout's (ep, etp) ranks

    def part_placement(self, index: int) -> Placement:
        return self.tp[index] if isinstance(self.tp, tuple) else self.tp

    def __repr__(self) -> str:
        extra = f", groups={self.groups}" if self.groups > 1 else ""
        extra += f", padded_rows={self.padded_rows}" if self.padded_rows else ""
        return f"{self.name} <- {'+'.join(self.parts)} tp={self.tp!r} stages={self.stages}{extra}"


class Piece(NamedTuple):
    """A rectangle of logical tensor ``tensor`` stored at (``local_row``, ``local_col``) of a local param."""

    tensor: str
    row: int
    col: int
    rows: int
    cols: int
    local_row: int
    local_col: int


class TrainingParamShape(NamedTuple):
    name: str
    shape: tuple[int, ...]


def as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """Every tensor is addressed as rows x cols (a 1-D tensor of n elements is n x 1)."""
    cols = 1
    for s in shape[1:]:
        cols *= s
    return shape[0], cols


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The logical (unfused, unpadded HF) tensors of the model, in HF order."""
    return model_spec(config.model_type).hf_shapes(config)


def placement(tp: TP) -> Placement:
    """The mesh placement of a spec's TP split: column and vocab split rows, row splits columns."""
    return {TP.REPLICATED: Replicate(), TP.COLUMN: Shard(0), TP.VOCAB: Shard(0), TP.ROW: Shard(1)}[tp]


def _shard_range(length: int, placement: Placement, dim: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[start, stop) of ``dim`` (of ``length``, padding included) that ``tp_rank`` holds."""
    if isinstance(placement, Replicate) or placement.dim != dim:
        return 0, length
    if isinstance(placement, ChunkShard):
        size = -(-length // tp_size)
        return min(tp_rank * size, length), min((tp_rank + 1) * size, length)
    chunks = tp_size // placement.replicas
    size = length // chunks
    chunk = tp_rank // placement.replicas
    return chunk * size, (chunk + 1) * size


def local_pieces(
    param: ParamLayout, shapes: dict[str, tuple[int, ...]], tp_size: int, tp_rank: int
) -> tuple[tuple[int, int], list[Piece]]:
    """(local rows x cols, pieces) of ``param`` on ``tp_rank``. Rows not covered by a piece are padding."""
    local_groups = param.groups
    if param.groups > 1:  # grouped fusion needs one row placement shared by all parts
        placement = param.part_placement(0)
        if isinstance(placement, Shard) and placement.dim == 0:
            local_groups = param.groups // (tp_size // placement.replicas)
    blocks = []  # per part: (name, row0, row1 (padded), real rows, col0, col1)
    for index, name in enumerate(param.parts):
        rows, cols = as_matrix(shapes[name])
        padded = param.padded_rows or rows
        placement = param.part_placement(index)
        r0, r1 = _shard_range(padded, placement, 0, tp_size, tp_rank)
        c0, c1 = _shard_range(cols, placement, 1, tp_size, tp_rank)
        blocks.append((name, r0, r1, rows, c0, c1))
    pieces: list[Piece] = []
    local_row = 0
    local_cols = blocks[0][5] - blocks[0][4]
    for g in range(local_groups):
        for name, r0, r1, real_rows, c0, c1 in blocks:
            per_group = (r1 - r0) // local_groups
            start = r0 + g * per_group
            real = max(0, min(start + per_group, real_rows) - start)
            if real:
                pieces.append(Piece(name, start, c0, real, c1 - c0, local_row, 0))
            local_row += per_group
    return (local_row, local_cols), pieces


def local_shape(param: ParamLayout, shapes: dict[str, tuple[int, ...]], tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """The local tensor's true shape (1-D params stay 1-D)."""
    (rows, cols), _ = local_pieces(param, shapes, tp_size, tp_rank)
    return (rows,) if len(shapes[param.parts[0]]) == 1 else (rows, cols)


def fill_local(param: ParamLayout, shapes: dict[str, tuple[int, ...]], tp_size: int, tp_rank: int, dst,
               source) -> None:
    """Write ``param``'s local tensor on ``tp_rank`` into the contiguous tensor ``dst`` from its full logical
    (1-D or 2-D) tensors: ``source(name)`` returns one indexable like the full tensor (a lazy safetensors slice
    reads only the rows and columns indexed). Local rows no piece covers (vocab padding) are zeroed."""
    (rows, cols), pieces = local_pieces(param, shapes, tp_size, tp_rank)
    local = dst.view(rows, cols)
    if sum(p.rows * p.cols for p in pieces) < rows * cols:
        local.zero_()
    for p in pieces:
        full = source(p.tensor)
        if len(shapes[p.tensor]) == 1:
            block = full[p.row:p.row + p.rows]
        else:
            block = full[p.row:p.row + p.rows, p.col:p.col + p.cols]
        local[p.local_row:p.local_row + p.rows, p.local_col:p.local_col + p.cols].copy_(block.reshape(p.rows, p.cols))


# --------------------------------------------------------------------------------------------
# Megatron training layout (megatron-core 0.16.1 GPTModel, local spec)
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainingLayout:
    """Megatron (p, t, d) and, for MoE models, expert parallelism (ep, etp).

    Global rank numbering follows parallel_state's default order ``tp-cp-ep-dp-pp`` with cp = 1 and its
    dense groups taking ep = 1: ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``. Expert parameters
    follow megatron's expert rank generator ``tp-ep-dp-pp`` with tp = etp over the same tp*dp ranks of a
    stage: with ``q = rank % (tp*dp)``, ``etp_rank = q % etp``, ``ep_rank = (q // etp) % ep`` (EP rank r holds
    experts ``[r*E/ep, (r+1)*E/ep)``), and the expert-DP replica is ``q // (etp*ep)``. ``etp`` None: tp."""

    tp: int
    pp: int
    dp: int = 1
    ep: int = 1
    etp: int | None = None

    def __post_init__(self):
        for key in ("tp", "pp", "dp", "ep"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"training {key}: expected a positive integer, found {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp <= 0):
            raise LayoutError(f"training etp: expected a positive integer or None, found {self.etp!r}")
        if (self.tp * self.dp) % (self.ep * self.expert_tp):
            raise LayoutError(f"training ep*etp={self.ep * self.expert_tp}: expected a divisor of the "
                              f"{self.tp * self.dp} ranks of a pipeline stage (tp*dp)")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank: expected 0 <= rank < {self.world_size}, found {rank}")
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

    def expert_coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, ep_rank, etp_rank) of a global rank in the expert layout."""
        stage = self.coords(rank)[0]
        q = rank % (self.tp * self.dp)
        return stage, (q // self.expert_tp) % self.ep, q % self.expert_tp

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def check(self, config: ModelConfig) -> None:
        t, problems = self.tp, []
        if config.num_query_groups % t:
            problems.append(f"num_key_value_heads={config.num_query_groups} (Megatron needs tp | query groups)")
        if config.num_attention_heads % t:
            problems.append(f"num_attention_heads={config.num_attention_heads}")
        if config.intermediate_size % t:
            problems.append(f"intermediate_size={config.intermediate_size}")
        if problems:
            raise LayoutError(f"training tp={t}: expected a divisor of the model's sizes, found it does not divide "
                              + ", ".join(problems))
        if config.num_hidden_layers % self.pp:
            raise LayoutError(
                f"training pp={self.pp}: expected a divisor of num_hidden_layers={config.num_hidden_layers}"
            )
        if not config.is_moe and (self.ep, self.expert_tp) != (1, self.tp):
            raise LayoutError(f"training ep={self.ep} etp={self.expert_tp}: expected ep=1 and etp=tp for a dense "
                              "model")
        if config.is_moe and (config.num_experts % self.ep or config.moe_intermediate_size % self.expert_tp):
            raise LayoutError(f"training ep={self.ep} etp={self.expert_tp}: expected ep | num_experts="
                              f"{config.num_experts} and etp | moe_intermediate_size={config.moe_intermediate_size}")

    def params(self, config: ModelConfig, pp_rank: int, ep_rank: int = 0) -> list[ParamLayout]:
        """The parameters stage ``pp_rank`` (EP rank ``ep_rank``) holds, in GPTModel state-dict order."""
        self.check(config)
        if not 0 <= pp_rank < self.pp:
            raise LayoutError(f"pp rank: expected 0 <= rank < {self.pp}, found {pp_rank}")
        if not 0 <= ep_rank < self.ep:
            raise LayoutError(f"ep rank: expected 0 <= rank < {self.ep}, found {ep_rank}")
        vocab = padded_vocab_size(config.vocab_size, self.tp)  # the model builder's padding rule
        # Megatron's linear_qkv interleaves q, k, v per query group; its fc1 stacks [gate shard; up shard].
        return [ParamLayout(p.mcore, p.hf, placement(p.train_tp), (pp_rank,),
                            groups=config.num_query_groups if p.fusion is Fusion.QKV else 1,
                            padded_rows=vocab if p.train_tp is TP.VOCAB else None,
                            expert=p.expert is not None)
                for p in model_spec(config.model_type).mcore_params(config, self.pp, pp_rank, "lm", self.ep, ep_rank)]

    # What the reshard's groups and planner ask of a training layout (the FSDP layout answers the same).
    def gathers_in_place(self, rollout_tp: int) -> bool:
        """HybridFlow's case: every training shard is part of one rollout shard (t_g divides t)."""
        return self.tp % rollout_tp == 0

    def reshard_reason(self, rollout_tp: int) -> str:
        """Why the reshard takes its path (the plan's summary)."""
        t = self.tp
        if self.gathers_in_place(rollout_tp):
            block = t // rollout_tp
            return (f"t_g={rollout_tp} divides t={t}: rollout tp rank = tp rank // {block}; all-gather inside "
                    f"micro-DP groups of p*t/t_g={self.pp * block} ranks; every training shard is part of its "
                    "rollout shard")
        relation = "is larger than" if rollout_tp > t else "does not divide"
        return (f"t_g={rollout_tp} {relation} t={t}: no zero-redundancy grouping exists; each rollout shard "
                f"goes to a rank whose training tp slice overlaps it (local slices first), the rest moves by "
                f"an all-to-all among the holders")

    def received_bound(self, rollout_tp: int, model_elems: int, expert_elems: int, own_elems: int,
                       held: Callable[[], int]) -> float | None:
        """The elements a rank's received bytes are held to (``ReshardPlan.bytes_formula``): HybridFlow's mean
        over ranks; the micro-DP group of p*t/t_g ranks holds the dense part of the rollout shard, each rank
        1/(p*t/t_g) of it, and (etp = t) only its EP rank's 1/ep of the experts, the rest coming from the other
        EP ranks. None off HybridFlow's case or with another etp."""
        if not self.gathers_in_place(rollout_tp) or self.expert_tp != self.tp:
            return None
        pt, tg, ep = self.pp * self.tp, rollout_tp, self.ep
        return (pt - tg) / (tg * pt) * (model_elems - expert_elems) + (pt * ep - tg) / (tg * pt * ep) * expert_elems

    def describe(self) -> str:
        """How summaries name the layout."""
        experts = "" if self.ep == 1 and self.etp is None else f", ep={self.ep}, etp={self.expert_tp}"
        return f"(p={self.pp}, t={self.tp}, d={self.dp}{experts})"


def training_param_specs(config: ModelConfig, tp: int, pp: int, tp_rank: int, pp_rank: int, ep: int = 1,
                         ep_rank: int = 0, etp: int | None = None,
                         etp_rank: int | None = None) -> list[TrainingParamShape]:
    """(name, shape) of every parameter of Megatron GPTModel (local spec) on (pp_rank, tp_rank) (and expert
    ranks (ep_rank, etp_rank); etp None: tp, etp_rank None: tp_rank), in state-dict order."""
    etp_size = tp if etp is None else etp
    # dp only has to make room for ep*etp: which parameters a rank holds does not depend on it.
    layout = TrainingLayout(tp=tp, pp=pp, dp=ep * etp_size, ep=ep, etp=etp)
    if not 0 <= tp_rank < tp:
        raise LayoutError(f"tp rank: expected 0 <= rank < {tp}, found {tp_rank}")
    shapes = hf_tensor_shapes(config)
    etp_rank = tp_rank if etp_rank is None else etp_rank
    return [TrainingParamShape(p.name, local_shape(p, shapes, etp_size, etp_rank) if p.expert
                      else local_shape(p, shapes, tp, tp_rank)) for p in layout.params(config, pp_rank, ep_rank)]


# --------------------------------------------------------------------------------------------
# FSDP2 training layout (torch.distributed.fsdp.fully_shard on a transformers model)
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FSDPLayout:
    """FSDP2 (``shard`` ranks) or HSDP (``replicate`` x ``shard``) on a transformers CausalLM: every
    parameter is its HF tensor, ``Shard(0)`` over the shard ranks with torch.chunk's uneven split.

    Global rank = ``replicate_index * shard + shard_index``, the row-major order of
    ``init_device_mesh(device, (replicate, shard), mesh_dim_names=("replicate", "shard"))`` (a 1-D mesh
    when ``replicate == 1``). For the planner it is a (p, t, d) = (1, shard, replicate) layout: the
    shard index plays Megatron's tp rank, the replicate index its dp rank.
    """

    shard: int
    replicate: int = 1

    def __post_init__(self):
        for key in ("shard", "replicate"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"fsdp {key}: expected a positive integer, found {value!r}")

    @property
    def tp(self) -> int:
        return self.shard

    @property
    def pp(self) -> int:
        return 1

    @property
    def dp(self) -> int:
        return self.replicate

    ep = 1  # experts are not placed apart under FSDP (and MoE models are refused: see check)

    @property
    def world_size(self) -> int:
        return self.shard * self.replicate

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage 0, replicate index, shard index) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank: expected 0 <= rank < {self.world_size}, found {rank}")
        return 0, rank // self.shard, rank % self.shard

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.shard + tp_rank

    def check(self, config: ModelConfig) -> None:
        """Nothing to divide: torch.chunk shards any size (ranks past the last row hold nothing). An MoE model
        is refused: transformers holds its experts fused ([E, 2I, H] per layer), not as the checkpoint's
        per-expert tensors this layout names."""
        if config.is_moe:
            raise LayoutError(f"FSDP training of {config.model_type}: expected a dense model (transformers fuses "
                              "the experts, which this layout does not describe); use the megatron strategy")

    def params(self, config: ModelConfig, pp_rank: int = 0) -> list[ParamLayout]:
        """One parameter per HF tensor, named as ``model.named_parameters()`` names it (tied: no output table)."""
        if pp_rank != 0:
            raise LayoutError(f"pp rank: expected 0 (FSDP has one stage), found {pp_rank}")
        self.check(config)
        return [ParamLayout(name, (name,), ChunkShard(0)) for name in hf_tensor_shapes(config)]

    def gathers_in_place(self, rollout_tp: int) -> bool:
        """t_g = 1 only: FSDP's row blocks are parts of the full model, not of row-parallel rollout shards."""
        return rollout_tp == 1

    def reshard_reason(self, rollout_tp: int) -> str:
        t = self.shard
        if self.gathers_in_place(rollout_tp):
            return (f"t_g=1: every rank needs the whole model; all-gather inside each replicate's shard "
                    f"group of {t} ranks (the micro-DP group); every FSDP shard is part of the full model")
        return (f"t_g={rollout_tp} > 1 over FSDP shard={t}: FSDP shards are row blocks of every HF tensor, "
                f"not parts of rollout TP shards (row-parallel weights split on dim 1); each rank copies what it "
                f"holds of its rollout shard locally, the rest moves by all-to-all from the least-loaded holder")

    def received_bound(self, rollout_tp: int, model_elems: int, expert_elems: int, own_elems: int,
                       held: Callable[[], int]) -> int:
        """This rank's own bound: its rollout shard (``own_elems``) minus what its FSDP shard ``held()`` of it
        (t_g = 1, even: (S-1)/S * M)."""
        return own_elems - held()

    def describe(self) -> str:
        return str(self)

    def __str__(self) -> str:
        return f"FSDP(shard={self.shard}, replicate={self.replicate})"


AnyTrainingLayout = TrainingLayout | FSDPLayout


def describe_training(training: AnyTrainingLayout) -> str:
    """How summaries name a training layout."""
    return training.describe()
