"""Mixtral: the Llama decoder with every MLP a mixture of experts (``block_sparse_moe``).

A top-k router (``block_sparse_moe.gate``) picks ``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts,
their weights renormalised over the chosen ones; each expert is ``w1`` (gate), ``w3`` (up) and ``w2`` (down) of
``intermediate_size``. Megatron's layer is the same MoELayer as Qwen3-MoE's (router, local experts' fc1 =
[w1 shard; w3 shard], fc2 = w2); the rollout stacks the experts as SGLang's Mixtral does
(``block_sparse_moe.experts.w13_weight`` / ``w2_weight``).
"""

from __future__ import annotations

import dataclasses

from verl.models.spec.base import MOE_LAYERS, TP, Fusion, ParamSpec
from verl.models.spec.dense import DENSE

_MG, _HF = "decoder.layers.{layer}.", "model.layers.{layer}."
_MOE = _HF + "block_sparse_moe."

MIXTRAL = dataclasses.replace(
    DENSE,
    model_types=("mixtral",),
    layer=tuple(p for p in DENSE.layer if p.role not in ("gate_up", "mlp_out")) + (
        ParamSpec("router", _MG + "mlp.router.weight", (_MOE + "gate.weight",),
                  lambda c: ((c.num_experts, c.hidden_size),), TP.REPLICATED, _MOE + "gate.weight", TP.REPLICATED,
                  layers=MOE_LAYERS),
        ParamSpec("expert_fc1", _MG + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
                  (_MOE + "experts.{expert}.w1.weight", _MOE + "experts.{expert}.w3.weight"),
                  lambda c: ((c.moe_intermediate_size, c.hidden_size),) * 2, TP.COLUMN,
                  _MOE + "experts.w13_weight", TP.COLUMN, Fusion.GATE_UP, layers=MOE_LAYERS, expert=True),
        ParamSpec("expert_fc2", _MG + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
                  (_MOE + "experts.{expert}.w2.weight",),
                  lambda c: ((c.hidden_size, c.moe_intermediate_size),), TP.ROW, _MOE + "experts.w2_weight",
                  TP.ROW, layers=MOE_LAYERS, expert=True),
    ),
    mcore_layer_order=tuple(r for r in DENSE.mcore_layer_order if r not in ("gate_up", "mlp_out"))
    + ("router", "expert_fc1", "expert_fc2"),
)

SPECS = (MIXTRAL,)
