"""The rollout engines' parameters: which tensors a rollout TP rank holds, their shapes and their order.

This is the layout SGLang 0.5.x builds, read off the model spec: the spec's rollout names in HF order,
q/k/v stacked as ``[q heads of the rank; its k heads; its v heads]`` (a KV head replicated over
``tp // kv_heads`` ranks when tp > kv heads), gate/up stacked as ``[gate shard; up shard]``, experts
stacked per layer (SGLang's fused MoE), column-parallel weights split on dim 0, row-parallel on dim 1,
vocab tables padded to a multiple of :data:`ROLLOUT_VOCAB_PADDING` and split on dim 0. Both rollout
engines allocate exactly these tensors (the native engine as views of one flat buffer, in this order), and
the 3D-HybridEngine's rollout layout (:mod:`verl.hybrid_engine.rollout_layout`) places the same tensors,
so one reshard serves both engines.
"""

from __future__ import annotations

import dataclasses

from verl.errors import InputError
from verl.models.config import ModelConfig
from verl.models.spec.base import TP, Fusion, Shape
from verl.models.spec.registry import model_spec

# SGLang pads the vocab table to a multiple of 64 before splitting it over rollout TP; the native engine copies it.
ROLLOUT_VOCAB_PADDING = 64


class RolloutLayoutError(InputError):
    """A rollout TP size the model cannot be split over."""


@dataclasses.dataclass(frozen=True)
class RolloutParamSpec:
    name: str  # the name SGLang's model holds it under (the spec's rollout name)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def padded_vocab_size(vocab_size: int) -> int:
    return -(-vocab_size // ROLLOUT_VOCAB_PADDING) * ROLLOUT_VOCAB_PADDING


def kv_heads_per_rank(config: ModelConfig, tp_size: int) -> int:
    """KV heads on one rollout rank: a shard when tp <= kv heads, else one replicated head."""
    return max(1, config.num_key_value_heads // tp_size)


def kv_head_of_rank(config: ModelConfig, tp_size: int, tp_rank: int) -> int:
    """First KV head held by ``tp_rank`` (SGLang replicates heads over tp // kv_heads ranks)."""
    if tp_size <= config.num_key_value_heads:
        return tp_rank * (config.num_key_value_heads // tp_size)
    return tp_rank // (tp_size // config.num_key_value_heads)


def check_rollout_tp(config: ModelConfig, tp_size: int) -> None:
    if tp_size <= 0:
        raise RolloutLayoutError(f"rollout tp: expected a positive integer, found {tp_size}")
    problems = []
    if config.num_attention_heads % tp_size:
        problems.append(f"num_attention_heads={config.num_attention_heads}")
    kv = config.num_key_value_heads
    if (kv % tp_size) if tp_size <= kv else (tp_size % kv):
        problems.append(f"num_key_value_heads={kv} (tp must divide it or be a multiple of it)")
    if config.intermediate_size % tp_size:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if config.is_moe and config.moe_intermediate_size % tp_size:
        problems.append(f"moe_intermediate_size={config.moe_intermediate_size} (every expert is split over tp)")
    if padded_vocab_size(config.vocab_size) % tp_size:
        problems.append(f"padded vocab {padded_vocab_size(config.vocab_size)}")
    if problems:
        raise RolloutLayoutError(f"rollout tp={tp_size}: expected a divisor of the model's sizes, found it does not "
                                 "divide " + ", ".join(problems))


def _local_rows(shape: Shape, split: TP, tp_size: int) -> Shape:
    """One HF tensor's part on a rollout rank under ``split`` (every split here is even)."""
    if split is TP.COLUMN:
        return (shape[0] // tp_size, *shape[1:])
    if split is TP.VOCAB:
        return (padded_vocab_size(shape[0]) // tp_size, *shape[1:])
    if split is TP.ROW:
        return (shape[0], shape[1] // tp_size, *shape[2:])
    return shape


def rollout_param_specs(config: ModelConfig, tp_size: int, tp_rank: int) -> list[RolloutParamSpec]:
    """Every tensor rollout rank ``tp_rank`` of ``tp_size`` holds, in flat-buffer order (the same shapes on every
    rank: each split is even). Fused parameters stack their parts' local rows; a tied model has no output table
    (the engine reuses the embedding)."""
    check_rollout_tp(config, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise RolloutLayoutError(f"rollout tp rank: expected 0 <= rank < {tp_size}, found {tp_rank}")
    kv_rows_per_head = kv_heads_per_rank(config, tp_size) * config.head_dim
    out = []
    for p in model_spec(config.model_type).rollout_params(config):
        if p.fusion is Fusion.QKV:  # [q heads of the rank; its k heads; its v heads]
            (q_rows, *rest), _, _ = p.shapes
            parts = [(q_rows // tp_size, *rest), (kv_rows_per_head, *rest), (kv_rows_per_head, *rest)]
        else:
            parts = [_local_rows(shape, p.rollout_tp, tp_size) for shape in p.shapes]
        rows = sum(part[0] for part in parts)
        out.append(RolloutParamSpec(p.rollout, (rows, *parts[0][1:])))
    return out
