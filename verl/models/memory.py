"""Estimated memory per training rank of a Megatron layout: weights, gradients, Adam state, and the colocated
rollout's copy of the weights, from the model spec (what ``verl train --dry-run`` prints before any rank starts).

Counted per rank of the fullest pipeline stage: each parameter's elements over its split (dense ones over tp,
vocab tables padded as Megatron pads them, experts over ep and etp, norms and routers whole). Bytes per
element: the weights in the training dtype; gradients in fp32 (megatron's ``grad_reduce_in_fp32``); Adam's two
moments in fp32, plus an fp32 master copy when the weights are bf16/fp16, all divided by the (expert-)data-
parallel size under the distributed optimizer. The rollout holds its tp shard of the whole model (every
expert) in the rollout dtype. Activations, the KV cache and allocator slack are not counted.
"""

from __future__ import annotations

import dataclasses
import math

from verl.models.config import ModelConfig
from verl.models.mcore.model import padded_vocab_size
from verl.models.spec.base import TP
from verl.models.spec.registry import model_spec

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class RankMemory:
    params: int            # training parameters on the fullest rank
    expert_params: int     # of which expert parameters
    weights_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    rollout_bytes: int     # the colocated rollout's weights (its tp shard, every expert)

    @property
    def training_bytes(self) -> int:
        return self.weights_bytes + self.grad_bytes + self.optimizer_bytes

    def summary(self) -> str:
        gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        return (f"estimated memory per rank: {self.params / 1e9:.2f}B training params ({self.expert_params / 1e9:.2f}B "
                f"in experts): weights {gib(self.weights_bytes)} + grads {gib(self.grad_bytes)} + Adam state "
                f"{gib(self.optimizer_bytes)} = {gib(self.training_bytes)}; rollout weights {gib(self.rollout_bytes)}; "
                f"activations and KV cache not counted")


def _numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def estimate_rank_memory(config: ModelConfig, *, tp: int, pp: int, dp: int, ep: int = 1, etp: int | None = None,
                         dtype_bytes: int = 2, distributed_optimizer: bool = True, rollout_tp: int = 1,
                         rollout_dtype_bytes: int | None = None) -> RankMemory:
    etp = tp if etp is None else etp
    spec = model_spec(config.model_type)
    vocab = padded_vocab_size(config.vocab_size, tp)
    fullest = (0, 0)
    for stage in range(pp):
        dense = experts = 0
        for p in spec.mcore_params(config, pp, stage, "lm", ep, 0):
            n = _numel(p.shapes)
            if p.train_tp is TP.VOCAB:
                n = n * vocab // config.vocab_size
            if p.expert is not None:
                experts += n // etp
            elif p.train_tp is not TP.REPLICATED:
                dense += n // tp
            else:
                dense += n
        fullest = max(fullest, (dense + experts, experts))
    params, expert_params = fullest
    master = 4 if dtype_bytes < 4 else 0  # fp32 main params beside bf16/fp16 weights
    edp = max(1, dp * tp // (ep * etp))
    shard = (lambda n, d: n / d) if distributed_optimizer else (lambda n, d: n)
    optimizer = shard((params - expert_params) * (8 + master), dp) + shard(expert_params * (8 + master), edp)
    rollout_elems = sum(_numel(p.shapes) for p in spec.rollout_params(config)) // rollout_tp
    return RankMemory(params=params, expert_params=expert_params, weights_bytes=params * dtype_bytes,
                      grad_bytes=params * 4, optimizer_bytes=int(optimizer),
                      rollout_bytes=rollout_elems * (rollout_dtype_bytes or dtype_bytes))
