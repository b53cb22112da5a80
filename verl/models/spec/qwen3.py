"""Qwen3 (dense) and Qwen3-MoE: the dense family plus per-head q/k RMSNorm, and routed experts.

Qwen3 is Qwen2 without the qkv bias and with ``q_norm`` / ``k_norm`` (an RMSNorm over each head's
``head_dim`` features, before RoPE; one weight shared by all heads, so it is replicated under TP).
Qwen3-MoE replaces the MLP of its sparse layers (``ModelConfig.moe_layers``) by a top-k router over
``num_experts`` SwiGLU experts without a shared expert. Per MoE layer:

  role        Megatron (decoder.layers.{k}.mlp.)    HF (model.layers.{i}.mlp.)   rollout (SGLang)
  router      router.weight [E, H]                 gate.weight                  gate.weight, replicated
  expert_fc1  experts.local_experts.{j}.linear_fc1  experts.{e}.{gate,up}_proj   experts.w13_weight [E, 2I/tp, H]
  expert_fc2  experts.local_experts.{j}.linear_fc2  experts.{e}.down_proj        experts.w2_weight [E, H, I/tp]

Megatron splits the experts over expert-parallel ranks (local expert ``j`` of EP rank ``r`` is expert
``r*E/ep + j``) and each expert over the expert-tensor-parallel ranks as its dense MLP (fc1 column-parallel
``[gate shard; up shard]``, fc2 row-parallel). The rollout holds every expert on every rank, tensor-parallel
inside each expert, as SGLang's fused MoE does with ``ep_size=1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.models.spec.base import (
    DENSE_LAYERS,
    TP,
    ModelConfigError,
    ParamSpec,
    moe_layer_params,
    read_decoder,
    read_moe,
)
from verl.models.spec.dense import LLAMA

_MG, _HF = "decoder.layers.{layer}.", "model.layers.{layer}."


def _head_norm(x: str) -> ParamSpec:
    return ParamSpec(f"{x}_norm", _MG + f"self_attention.{x}_layernorm.weight", (_HF + f"self_attn.{x}_norm.weight",),
                     lambda c: ((c.head_dim,),), TP.REPLICATED, _HF + f"self_attn.{x}_norm.weight", TP.REPLICATED)


def _layer(with_experts: bool) -> tuple[ParamSpec, ...]:
    out = []
    for p in LLAMA.layer:
        if p.role in ("gate_up", "mlp_out") and with_experts:
            p = dataclasses.replace(p, layers=DENSE_LAYERS)
        out.append(p)
        if p.role == "attn_out":
            out += [_head_norm("q"), _head_norm("k")]
    if with_experts:
        out += moe_layer_params(_HF + "mlp.", "gate_proj", "up_proj", "down_proj")
    return tuple(out)


def _mcore_order(with_experts: bool) -> tuple[str, ...]:
    order = []
    for role in LLAMA.mcore_layer_order:
        order.append(role)
        if role == "qkv_bias":  # Megatron builds q_layernorm / k_layernorm after linear_qkv
            order += ["q_norm", "k_norm"]
    return tuple(order) + (("router", "expert_fc1", "expert_fc2") if with_experts else ())


def _read_qwen3(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {**read_decoder(cfg), "qk_norm": True}


def _read_qwen3_moe(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Sparse layers: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (transformers' rule)."""
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelConfigError("shared_expert_intermediate_size: expected 0 for qwen3_moe (no shared expert), "
                               f"found {cfg['shared_expert_intermediate_size']}")
    fields = _read_qwen3(cfg)
    step = int(cfg.get("decoder_sparse_step", 1))
    if step <= 0:
        raise ModelConfigError(f"decoder_sparse_step: expected a positive integer, found {step}")
    dense = set(cfg.get("mlp_only_layers") or ())
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    moe = read_moe(cfg, experts, int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False)),
                   tuple(i for i in range(fields["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0))
    if experts <= 0:
        raise ModelConfigError(f"num_experts: expected a positive integer for qwen3_moe, "
                               f"found {cfg.get('num_experts')!r}")
    return {**fields, **moe}


QWEN3 = dataclasses.replace(LLAMA, model_types=("qwen3",), architecture="Qwen3ForCausalLM", read_hf_config=_read_qwen3,
                            layer=_layer(False), mcore_layer_order=_mcore_order(False))
QWEN3_MOE = dataclasses.replace(LLAMA, model_types=("qwen3_moe",), architecture="Qwen3MoeForCausalLM",
                                read_hf_config=_read_qwen3_moe, layer=_layer(True),
                                mcore_layer_order=_mcore_order(True))

SPECS = (QWEN3, QWEN3_MOE)
