"""The dense decoder family: Qwen2 and Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP).

They differ only in the HF architecture name and the qkv bias (always on for Qwen2, ``attention_bias``
for Llama), which the config carries; tied embeddings drop the lm head. Per layer (HF order; Megatron creates
``linear_proj`` before ``linear_qkv``, so its state dict lists the attention output first):

  role       Megatron (decoder.layers.{k}.)   HF (model.layers.{i}.)           tp
  attn_norm  input_layernorm.weight          input_layernorm.weight            replicated
  qkv        self_attention.linear_qkv.weight   self_attn.{q,k,v}_proj.weight   column, QKV
  qkv_bias   self_attention.linear_qkv.bias     self_attn.{q,k,v}_proj.bias     column, QKV (with the bias)
  attn_out   self_attention.linear_proj.weight  self_attn.o_proj.weight         row
  mlp_norm   pre_mlp_layernorm.weight        post_attention_layernorm.weight   replicated
  gate_up    mlp.linear_fc1.weight           mlp.{gate,up}_proj.weight         column, GATE_UP
  mlp_out    mlp.linear_fc2.weight           mlp.down_proj.weight              row

SGLang holds the fused ones as ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` and the rest under
their HF names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.models.spec.base import TP, Fusion, ModelSpec, ParamSpec, read_decoder

_MG, _HF = "decoder.layers.{layer}.", "model.layers.{layer}."


def _qkv_shapes(suffix: str):
    def shapes(c):
        tail = (c.hidden_size,) if suffix == "weight" else ()
        return (c.q_size, *tail), (c.kv_size, *tail), (c.kv_size, *tail)
    return shapes


def _norm(role: str, mcore: str, hf: str) -> ParamSpec:
    return ParamSpec(role, mcore, (hf,), lambda c: ((c.hidden_size,),), TP.REPLICATED, hf, TP.REPLICATED)


def _qkv(role: str, suffix: str, **kw) -> ParamSpec:
    return ParamSpec(role, _MG + f"self_attention.linear_qkv.{suffix}",
                     tuple(_HF + f"self_attn.{x}_proj.{suffix}" for x in "qkv"), _qkv_shapes(suffix),
                     TP.COLUMN, _HF + f"self_attn.qkv_proj.{suffix}", TP.COLUMN, Fusion.QKV, **kw)


LLAMA = ModelSpec(
    model_types=("llama",),
    architecture="LlamaForCausalLM",
    read_hf_config=read_decoder,
    embedding=ParamSpec("embedding", "embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                        lambda c: ((c.vocab_size, c.hidden_size),), TP.VOCAB, "model.embed_tokens.weight", TP.VOCAB),
    layer=(
        _norm("attn_norm", _MG + "input_layernorm.weight", _HF + "input_layernorm.weight"),
        _qkv("qkv", "weight"),
        _qkv("qkv_bias", "bias", present=lambda c: c.attention_bias),
        ParamSpec("attn_out", _MG + "self_attention.linear_proj.weight", (_HF + "self_attn.o_proj.weight",),
                  lambda c: ((c.hidden_size, c.q_size),), TP.ROW, _HF + "self_attn.o_proj.weight", TP.ROW),
        _norm("mlp_norm", _MG + "pre_mlp_layernorm.weight", _HF + "post_attention_layernorm.weight"),
        ParamSpec("gate_up", _MG + "mlp.linear_fc1.weight", (_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"),
                  lambda c: ((c.intermediate_size, c.hidden_size),) * 2, TP.COLUMN, _HF + "mlp.gate_up_proj.weight",
                  TP.COLUMN, Fusion.GATE_UP),
        ParamSpec("mlp_out", _MG + "mlp.linear_fc2.weight", (_HF + "mlp.down_proj.weight",),
                  lambda c: ((c.hidden_size, c.intermediate_size),), TP.ROW, _HF + "mlp.down_proj.weight", TP.ROW),
    ),
    mcore_layer_order=("attn_norm", "attn_out", "qkv", "qkv_bias", "mlp_norm", "gate_up", "mlp_out"),
    final=(_norm("final_norm", "decoder.final_layernorm.weight", "model.norm.weight"),),
    lm_head=ParamSpec("output", "output_layer.weight", ("lm_head.weight",), lambda c: ((c.vocab_size, c.hidden_size),),
                      TP.VOCAB, "lm_head.weight", TP.VOCAB),
    score_head=ParamSpec("score", "output_layer.weight", ("score.weight",), lambda c: ((1, c.hidden_size),),
                         TP.REPLICATED, None, TP.REPLICATED),
    # Llama's attention_bias also biases o_proj, and mlp_bias the MLP: no layout here has those tensors.
    unsupported_hf=("o_proj.bias", "down_proj.bias", "gate_proj.bias", "up_proj.bias"),
    unsupported_note="the rollout layout has no o_proj/MLP biases (attention_bias on Llama / mlp_bias are not "
                     "supported)",
)



def _read_qwen2(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {**read_decoder(cfg), "attention_bias": True}  # Qwen2's q/k/v projections always have a bias


QWEN2 = dataclasses.replace(LLAMA, model_types=("qwen2",), architecture="Qwen2ForCausalLM",
                            read_hf_config=_read_qwen2)

SPECS = (QWEN2, LLAMA)
