"""Mixtral: the Llama decoder with every MLP a mixture of experts (``block_sparse_moe``).

A top-k router (``block_sparse_moe.gate``) picks ``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts,
their weights renormalised over the chosen ones; each expert is ``w1`` (gate), ``w3`` (up) and ``w2`` (down) of
``intermediate_size``. Megatron's layer is the same MoELayer as Qwen3-MoE's (router, local experts' fc1 =
[w1 shard; w3 shard], fc2 = w2); the rollout stacks the experts as SGLang's Mixtral does
(``block_sparse_moe.experts.w13_weight`` / ``w2_weight``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.models.spec.base import ModelConfigError, moe_layer_params, read_decoder, read_moe
from verl.models.spec.dense import LLAMA


def _read_mixtral(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer sparse, the experts ``intermediate_size`` wide, the top-k weights always renormalised."""
    if cfg.get("sliding_window") is not None:
        raise ModelConfigError(f"sliding_window: expected null for mixtral (sliding-window attention is not "
                               f"supported), found {cfg['sliding_window']}")
    fields = read_decoder(cfg)
    return {**fields, **read_moe(cfg, int(cfg["num_local_experts"]), fields["intermediate_size"], True,
                                 tuple(range(fields["num_hidden_layers"])))}


MIXTRAL = dataclasses.replace(
    LLAMA,
    model_types=("mixtral",),
    architecture="MixtralForCausalLM",
    read_hf_config=_read_mixtral,
    layer=tuple(p for p in LLAMA.layer if p.role not in ("gate_up", "mlp_out"))
    + moe_layer_params("model.layers.{layer}.block_sparse_moe.", "w1", "w3", "w2"),
    mcore_layer_order=tuple(r for r in LLAMA.mcore_layer_order if r not in ("gate_up", "mlp_out"))
    + ("router", "expert_fc1", "expert_fc2"),
)

SPECS = (MIXTRAL,)
