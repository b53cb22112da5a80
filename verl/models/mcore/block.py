"""The decoder-block features of :class:`ModelConfig` beyond megatron's Llama block, as local-spec modules.

megatron-core's local GPT layer is the Llama/Qwen block. Other families' blocks depart from it in ways their configs
state as data (``ModelConfig.block_features``), each computed here as transformers and the native engine compute it:

  norm_weight_offset, norm_scale_in_float32   :class:`BlockRMSNorm` for every norm of the model (the layers', the
                                              q/k norms and the final one): RMSNorm in float32 scaled by
                                              (offset + w), cast back; its weight is stored as HF stores it (w - 1)
  attn_post_norm, mlp_post_norm (spec roles)  :class:`BlockSelfAttention` / :class:`BlockMLP` own a norm of their
                                              output, before the residual add ("sandwich" norms)
  sliding_window, sliding_layers              megatron's own ``window_size`` / ``window_attn_skip_freq`` (which
                                              layers slide), applied by ``SDPACoreAttention``'s mask
  sliding_rope_theta                          a layer whose RoPE differs from the model's computes its own table
                                              (:class:`BlockSelfAttention`), from the same ``inv_freq`` function
  embedding_multiplier, final_logit_softcapping
                                              hooks on the embedding's and the output layer's outputs
  hidden_act, query_pre_attn_scalar           TransformerConfig's ``activation_func`` and ``softmax_scale``

Parameter names (the spec's ``decoder.layers.{i}.self_attention.post_layernorm.weight`` and
``...mlp.post_layernorm.weight``) and their order follow from where the modules sit.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

from verl.models.config import ModelConfig
from verl.models.rope import inv_freq as rope_inv_freq


class BlockRMSNorm(torch.nn.Module):
    """RMSNorm whose scale is (``weight_offset`` + weight), applied in float32 when ``scale_in_float32`` (the HF order
    of such norms: normalise and scale in float32, then cast), else in the input's dtype. A fresh weight scales by 1."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0,
                 scale_in_float32: bool = False):
        super().__init__()
        self.eps, self.weight_offset, self.scale_in_float32 = eps, weight_offset, scale_in_float32
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), 1.0 - weight_offset, dtype=config.params_dtype))
        # As megatron's norms: under sequence parallelism each TP rank's gradient covers its own tokens, summed over
        # TP by finalize_model_grads for parameters tagged so.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_in_float32:
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
            return (normed * (self.weight.float() + self.weight_offset)).to(x.dtype)
        weight = self.weight + self.weight_offset if self.weight_offset else self.weight
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


def norm_params(config: ModelConfig) -> dict:
    return {"weight_offset": config.norm_weight_offset, "scale_in_float32": config.norm_scale_in_float32}


class BlockSelfAttention(SelfAttention):
    """megatron's SelfAttention with this layer's own RoPE where the config gives it one (a sliding layer's base)
    and, where ``post_norm`` is set, a norm of its output."""

    def __init__(self, config, submodules, layer_number: int, *args, model_config: ModelConfig,
                 post_norm: bool = False, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        layer = self.layer_number - 1  # megatron's layer numbers are global and 1-based
        theta, scaling = model_config.layer_rope_theta(layer)
        self.layer_inv_freq = None
        if (theta, scaling) != (model_config.rope_theta, model_config.rope):
            self.layer_inv_freq, _ = rope_inv_freq(model_config.head_dim, theta, scaling)
        self.post_layernorm = (BlockRMSNorm(config, config.hidden_size, config.layernorm_epsilon,
                                            **norm_params(model_config)) if post_norm else None)

    def _layer_rotary(self, model_rotary: torch.Tensor) -> torch.Tensor:
        """This layer's [s, 1, 1, head_dim] RoPE angles for the model's table's positions 0..s-1 (megatron's
        RotaryEmbedding math: the outer product of positions and inv_freq, the two halves repeated)."""
        positions = torch.arange(model_rotary.shape[0], device=model_rotary.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.layer_inv_freq.to(model_rotary.device))
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :].to(model_rotary.dtype)

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        rotary = kwargs.get("rotary_pos_emb")
        if self.layer_inv_freq is not None and rotary is not None:
            if isinstance(rotary, tuple) or self.config.context_parallel_size > 1:
                raise NotImplementedError("a per-layer RoPE with context parallelism or separate q/k tables")
            kwargs["rotary_pos_emb"] = self._layer_rotary(rotary)
        output, bias = super().forward(hidden_states, attention_mask, *args, **kwargs)
        if self.post_layernorm is not None:
            if bias is not None:  # (add_bias_linear is off for every model the spec builds)
                raise NotImplementedError("a post-attention norm with a projection bias")
            output = self.post_layernorm(output)
        return output, bias


class _BlockMLPIsKnown(logging.Filter):
    """megatron's TransformerLayer passes its TP group only to MLP classes it knows by identity and warns for any
    other; BlockMLP takes the same default group (the process's TP group), so the warning is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


class BlockMLP(MLP):
    """megatron's MLP with a norm of its output (``mlp_post_norm``)."""

    def __init__(self, config, submodules, *args, model_config: ModelConfig, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_layernorm = BlockRMSNorm(config, config.hidden_size, config.layernorm_epsilon,
                                           **norm_params(model_config))

    def forward(self, hidden_states, *args, **kwargs):
        output, bias = super().forward(hidden_states, *args, **kwargs)
        if bias is not None:
            raise NotImplementedError("a post-MLP norm with an MLP bias")
        return self.post_layernorm(output), bias


_BLOCK_MLP_IS_KNOWN = _BlockMLPIsKnown()


def block_layer_spec(config: ModelConfig, base):
    """``base`` (megatron's local dense layer spec) with this config's block features: every norm a
    :class:`BlockRMSNorm` when the norms are offset or scaled in float32, the attention a
    :class:`BlockSelfAttention` (per-layer RoPE, its post-norm), the MLP a :class:`BlockMLP` when the spec has a
    post-MLP norm. Unchanged for the Llama block. Returns (layer spec, final norm spec or None)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    from verl.models.config import POST_NORM_ROLES
    from verl.models.spec.registry import model_spec

    roles = {p.role for p in model_spec(config.model_type).layer} & set(POST_NORM_ROLES)
    layer = base.submodules
    final_norm = None
    if config.norm_weight_offset or config.norm_scale_in_float32:
        final_norm = ModuleSpec(module=BlockRMSNorm, params=norm_params(config))
        layer.input_layernorm = layer.pre_mlp_layernorm = final_norm
        attention = layer.self_attention.submodules
        if attention.q_layernorm is not IdentityOp:
            attention.q_layernorm = attention.k_layernorm = final_norm
    layer.self_attention = ModuleSpec(
        module=BlockSelfAttention,
        params={**layer.self_attention.params, "model_config": config, "post_norm": "attn_post_norm" in roles},
        submodules=layer.self_attention.submodules)
    if "mlp_post_norm" in roles:
        logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_BLOCK_MLP_IS_KNOWN)
        layer.mlp = ModuleSpec(module=BlockMLP, params={**layer.mlp.params, "model_config": config},
                               submodules=layer.mlp.submodules)
    return base, final_norm


def add_output_hooks(model, config: ModelConfig, head: str) -> None:
    """The embedding times ``embedding_multiplier`` (cast to the activations' dtype, as HF multiplies) and the lm
    head's logits soft-capped, c * tanh(logits / c), where the config sets them."""
    multiplier, cap = config.embedding_multiplier, config.final_logit_softcapping
    embedding = getattr(model, "embedding", None)
    if multiplier != 1.0 and embedding is not None:
        def scale(module, inputs, output):
            return output * torch.tensor(multiplier, dtype=output.dtype, device=output.device)
        embedding.register_forward_hook(scale)
    output_layer = getattr(model, "output_layer", None)
    if cap and output_layer is not None and head == "lm":
        def softcap(module, inputs, output):
            logits, bias = output
            return torch.tanh(logits / cap) * cap, bias
        output_layer.register_forward_hook(softcap)
