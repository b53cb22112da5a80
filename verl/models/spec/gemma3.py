"""Gemma 3 (text): the Qwen3 block (q/k RMSNorm per head) with Gemma's departures, all of them config data.

Per layer (HF order):

  role           HF (model.layers.{i}.)                 rollout name        tp
  attn_norm      input_layernorm.weight                 (same)              replicated
  qkv            self_attn.{q,k,v}_proj.weight          self_attn.qkv_proj  column, QKV
  attn_out       self_attn.o_proj.weight                (same)              row
  q_norm/k_norm  self_attn.{q,k}_norm.weight [head_dim] (same)              replicated
  attn_post_norm post_attention_layernorm.weight        (same)              replicated  (on the attention's output)
  mlp_norm       pre_feedforward_layernorm.weight       (same)              replicated
  gate_up        mlp.{gate,up}_proj.weight              mlp.gate_up_proj    column, GATE_UP
  mlp_out        mlp.down_proj.weight                   (same)              row
  mlp_post_norm  post_feedforward_layernorm.weight      (same)              replicated  (on the MLP's output)

Note ``post_attention_layernorm`` is Llama's pre-MLP norm but Gemma's norm *after* the attention. The config reader
turns the rest into ModelConfig fields the engines read: ``layer_types`` -> ``sliding_layers`` with
``sliding_window``; ``rope_parameters.{full,sliding}_attention`` -> ``rope_theta``/``rope`` and
``sliding_rope_theta``; every RMSNorm weight stored as w - 1 (``norm_weight_offset`` 1, scaled in float32);
``hidden_activation`` (GeGLU with ``gelu_pytorch_tanh``); the embedding times sqrt(hidden); ``query_pre_attn_scalar``;
the final logits' soft-capping (null in Gemma 3's configs; the attention's is refused: transformers' Gemma 3
ignores it). Megatron builds the block from the same fields (``verl.models.mcore.block``): its post-norms sit in
the attention and the MLP modules, hence their Megatron names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.models.spec.base import TP, ModelConfigError, ParamSpec, read_decoder, read_rope_by_kind
from verl.models.spec.qwen3 import QWEN3

_MG, _HF = "decoder.layers.{layer}.", "model.layers.{layer}."
KINDS = ("full_attention", "sliding_attention")


def _norm(role: str, mcore: str, hf: str) -> ParamSpec:
    return ParamSpec(role, _MG + mcore, (_HF + hf,), lambda c: ((c.hidden_size,),), TP.REPLICATED, _HF + hf,
                     TP.REPLICATED)


def _read_gemma3(cfg: Mapping[str, Any]) -> dict[str, Any]:
    layers = int(cfg["num_hidden_layers"])
    kinds = list(cfg.get("layer_types") or ["full_attention"] * layers)
    if len(kinds) != layers or set(kinds) - set(KINDS):
        raise ModelConfigError(f"layer_types: expected {layers} entries of {KINDS}, found {kinds!r}")
    if cfg.get("attention_bias"):
        raise ModelConfigError("attention_bias: expected false for gemma3_text (its layout has no projection biases), "
                               "found true")
    if cfg.get("attn_logit_softcapping") is not None:  # (transformers' Gemma 3 attention never reads it)
        raise ModelConfigError(f"attn_logit_softcapping: expected null for gemma3_text (transformers' Gemma 3 does "
                               f"not apply it), found {cfg['attn_logit_softcapping']!r}")
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention: expected false (a causal language model), found true")
    rope = read_rope_by_kind(cfg, KINDS)
    sliding = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    if sliding and rope["sliding_attention"]["rope"] is not None:
        raise ModelConfigError("rope_parameters.sliding_attention.rope_type: expected 'default' (the sliding "
                               f"layers' RoPE is plain), found {rope['sliding_attention']['rope'].rope_type!r}")
    hidden = int(cfg["hidden_size"])
    return {
        **read_decoder(cfg, rope["full_attention"]),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "qk_norm": True,
        "hidden_act": str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"),
        "norm_weight_offset": 1.0,
        "norm_scale_in_float32": True,
        "embedding_multiplier": hidden ** 0.5,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 0.0),
        "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0),
        "sliding_window": int(cfg.get("sliding_window") or 0) if sliding else 0,
        "sliding_layers": sliding,
        "sliding_rope_theta": rope["sliding_attention"]["rope_theta"] if sliding else 0.0,
    }


def _layer() -> tuple[ParamSpec, ...]:
    by_role = {p.role: p for p in QWEN3.layer}
    return (
        by_role["attn_norm"], by_role["qkv"], by_role["attn_out"], by_role["q_norm"], by_role["k_norm"],
        _norm("attn_post_norm", "self_attention.post_layernorm.weight", "post_attention_layernorm.weight"),
        _norm("mlp_norm", "pre_mlp_layernorm.weight", "pre_feedforward_layernorm.weight"),
        by_role["gate_up"], by_role["mlp_out"],
        _norm("mlp_post_norm", "mlp.post_layernorm.weight", "post_feedforward_layernorm.weight"),
    )


GEMMA3 = dataclasses.replace(
    QWEN3, model_types=("gemma3_text",), architecture="Gemma3ForCausalLM", read_hf_config=_read_gemma3,
    layer=_layer(),
    mcore_layer_order=("attn_norm", "attn_out", "qkv", "q_norm", "k_norm", "attn_post_norm", "mlp_norm", "gate_up",
                       "mlp_out", "mlp_post_norm"),
)

SPECS = (GEMMA3,)
