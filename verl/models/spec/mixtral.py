"""Mixtral: the Llama decoder with every MLP a mixture of experts (``block_sparse_moe``).

A top-k router (``block_sparse_moe.gate``) picks ``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts,
their weights renormalised over the chosen ones; each expert is ``w1`` (gate), ``w3`` (up) and ``w2`` (down) of
``intermediate_size``. Megatron's layer is the same MoELayer as Qwen3-MoE's (router, local experts' fc1 =
[w1 shard; w3 shard], fc2 = w2); the rollout stacks the experts as SGLang's Mixtral does
(``block_sparse_moe.experts.w13_weight`` / ``w2_weight``).
"""

from __future__ import annotations

import dataclasses

from verl.models.spec.base import moe_layer_params
from verl.models.spec.dense import DENSE

MIXTRAL = dataclasses.replace(
    DENSE,
    model_types=("mixtral",),
    layer=tuple(p for p in DENSE.layer if p.role not in ("gate_up", "mlp_out"))
    + moe_layer_params("model.layers.{layer}.block_sparse_moe.", "w1", "w3", "w2"),
    mcore_layer_order=tuple(r for r in DENSE.mcore_layer_order if r not in ("gate_up", "mlp_out"))
    + ("router", "expert_fc1", "expert_fc2"),
)

SPECS = (MIXTRAL,)
