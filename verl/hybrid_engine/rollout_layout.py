"""The SGLang rollout layout as the reshard places it: which logical rectangle of each HF tensor a rollout TP
rank holds, as placement data for the planner.

The tensors themselves (names, shapes, flat-buffer order, vocab padding, KV-head replication) are the model
spec's rollout parameters (:mod:`verl.models.rollout_shapes`), which the rollout engines allocate; this module
places exactly those tensors, so a single reshard serves both engines. The shape helpers are re-exported here
for the reshard's callers.
"""

from __future__ import annotations

import dataclasses

from verl.hybrid_engine.layouts import ParamLayout, Replicate, Shard, placement
from verl.models.config import ModelConfig
from verl.models.rollout_shapes import (
    ROLLOUT_VOCAB_PADDING,
    RolloutLayoutError,
    RolloutParamSpec,
    check_rollout_tp,
    kv_head_of_rank,
    kv_heads_per_rank,
    padded_vocab_size,
    rollout_param_specs,
)
from verl.models.spec.base import TP, Fusion
from verl.models.spec.registry import model_spec

SGLANG_VOCAB_PADDING = ROLLOUT_VOCAB_PADDING

__all__ = ["SGLANG_VOCAB_PADDING", "RolloutLayout", "RolloutLayoutError", "RolloutParamSpec", "check_rollout_tp",
           "kv_head_of_rank", "kv_heads_per_rank", "kv_placement", "padded_vocab_size", "rollout_param_specs"]


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

