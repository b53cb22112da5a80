"""The SGLang rollout layout: which tensors a rollout TP rank holds, their shapes, and their order.

This is the layout SGLang 0.5.x builds, derived from the model spec (stacked QKV and gate/up,
vocab padded to a multiple of 64 and split across TP ranks; names are the spec's rollout names).
The embedded native engine allocates exactly these tensors as views of one flat buffer, in this
order, so a single reshard serves both engines.
"""

from __future__ import annotations

import dataclasses

from verl.errors import InputError
from verl.hybrid_engine.layouts import ParamLayout, Replicate, Shard, hf_tensor_shapes, local_shape, placement
from verl.models.config import ModelConfig
from verl.models.spec.base import TP, Fusion
from verl.models.spec.registry import model_spec

SGLANG_VOCAB_PADDING = 64


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
    return -(-vocab_size // SGLANG_VOCAB_PADDING) * SGLANG_VOCAB_PADDING


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


def kv_placement(config: ModelConfig, tp_size: int) -> Shard | Replicate:
    """k/v rows over rollout TP: sharded by head, each head on ``tp // kv_heads`` ranks when tp > kv heads."""
    kv = config.num_key_value_heads
    return Shard(0) if tp_size <= kv else Shard(0, replicas=tp_size // kv)


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """SGLang (p_g = 1, t_g, d_g): every rollout rank holds all layers; tp shards as below."""

    tp: int

    def params(self, config: ModelConfig) -> list[ParamLayout]:
        """Every parameter of a rollout TP rank, in flat-buffer order, as placement data."""
        check_rollout_tp(config, self.tp)
        vocab = padded_vocab_size(config.vocab_size)
        kv = kv_placement(config, self.tp)
        out = []
        for p in model_spec(config.model_type).rollout_params(config):
            tp = (Shard(0), kv, kv) if p.fusion is Fusion.QKV else placement(p.rollout_tp)
            out.append(ParamLayout(p.rollout, p.hf, tp, padded_rows=vocab if p.rollout_tp is TP.VOCAB else None))
        return out


def rollout_param_specs(config: ModelConfig, tp_size: int, tp_rank: int) -> list[RolloutParamSpec]:
    """Every tensor rollout rank ``tp_rank`` of ``tp_size`` holds, in flat-buffer order.

    Per rank (G = tp_size): fused QKV rows are [q heads of the rank; its k heads; its v heads];
    fused gate/up rows are [gate shard; up shard]; row-parallel weights are split on the input dim;
    vocab tables hold rows [r*Vp/G, (r+1)*Vp/G) of the table padded to Vp. A tied model has no
    output table (the engine reuses the embedding).
    """
    params = RolloutLayout(tp_size).params(config)
    if not 0 <= tp_rank < tp_size:
        raise RolloutLayoutError(f"rollout tp rank: expected 0 <= rank < {tp_size}, found {tp_rank}")
    shapes = hf_tensor_shapes(config)
    return [RolloutParamSpec(p.name, local_shape(p, shapes, tp_size, tp_rank)) for p in params]
