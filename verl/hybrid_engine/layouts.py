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


class ParamSpec(NamedTuple):
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
    """Megatron (p, t, d); global rank numbering follows parallel_state's default order
    ``tp-cp-ep-dp-pp`` with cp = ep = 1: ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``."""

    tp: int
    pp: int
    dp: int = 1

    def __post_init__(self):
        for key in ("tp", "pp", "dp"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise LayoutError(f"training {key}: expected a positive integer, found {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank: expected 0 <= rank < {self.world_size}, found {rank}")
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

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

    def params(self, config: ModelConfig, pp_rank: int) -> list[ParamLayout]:
        """The parameters stage ``pp_rank`` holds, in GPTModel state-dict order."""
        self.check(config)
        if not 0 <= pp_rank < self.pp:
            raise LayoutError(f"pp rank: expected 0 <= rank < {self.pp}, found {pp_rank}")
        vocab = padded_vocab_size(config.vocab_size, self.tp)  # the model builder's padding rule
        # Megatron's linear_qkv interleaves q, k, v per query group; its fc1 stacks [gate shard; up shard].
        return [ParamLayout(p.mcore, p.hf, placement(p.train_tp), (pp_rank,),
                            groups=config.num_query_groups if p.fusion is Fusion.QKV else 1,
                            padded_rows=vocab if p.train_tp is TP.VOCAB else None)
                for p in model_spec(config.model_type).mcore_params(config, self.pp, pp_rank)]


def training_param_specs(config: ModelConfig, tp: int, pp: int, tp_rank: int, pp_rank: int) -> list[ParamSpec]:
    """(name, shape) of every parameter of Megatron GPTModel (local spec) on (pp_rank, tp_rank), in
    state-dict order."""
    layout = TrainingLayout(tp=tp, pp=pp)
    if not 0 <= tp_rank < tp:
        raise LayoutError(f"tp rank: expected 0 <= rank < {tp}, found {tp_rank}")
    shapes = hf_tensor_shapes(config)
    return [ParamSpec(p.name, local_shape(p, shapes, tp, tp_rank)) for p in layout.params(config, pp_rank)]


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
        """Nothing to divide: torch.chunk shards any size (ranks past the last row hold nothing)."""

    def params(self, config: ModelConfig, pp_rank: int = 0) -> list[ParamLayout]:
        """One parameter per HF tensor, named as ``model.named_parameters()`` names it (tied: no output table)."""
        if pp_rank != 0:
            raise LayoutError(f"pp rank: expected 0 (FSDP has one stage), found {pp_rank}")
        return [ParamLayout(name, (name,), ChunkShard(0)) for name in hf_tensor_shapes(config)]

    def __str__(self) -> str:
        return f"FSDP(shard={self.shard}, replicate={self.replicate})"


AnyTrainingLayout = TrainingLayout | FSDPLayout


def describe_training(training: AnyTrainingLayout) -> str:
    """How summaries name a training layout."""
    if isinstance(training, FSDPLayout):
        return str(training)
    return f"(p={training.pp}, t={training.tp}, d={training.dp})"
