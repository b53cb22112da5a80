"""megatron's local core attention computed by torch's ``scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` (the non-Transformer-Engine spec this project builds on CPU and on
GPU hosts without TE) materialises the [b * heads, s, s] scores with ``baddbmm``, masks and softmaxes them in
separate ops and repeats each KV head for its query group. ``SDPACoreAttention`` gives the same result through
one fused kernel (the CPU build's flash attention, forward and backward, GQA without the repeat): about half the
attention time of a SmolLM2 training step on this CPU.

Only real tokens' outputs are the same: a query row whose every key is masked (a padding token with nothing
before it) attends to itself here (megatron's -10000 fill attends uniformly) so that no row is empty, which
would make the kernel return NaN. Those rows are padding, never read by a loss. A sliding-window layer (megatron's
``window_size`` on this layer, see ``verl.models.mcore.model.window_settings``) adds its band to the mask: megatron's
own window mask is built on CUDA only. Anything else the fused kernel does not cover (packed sequences, attention
bias, dropout, a softmax offset, query-key layer scaling) takes megatron's own path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SDPACoreAttention(DotProductAttention):
    """``DotProductAttention`` with its forward through ``F.scaled_dot_product_attention`` (see the module doc)."""

    def _fused(self, attention_mask: torch.Tensor | None, attention_bias, packed_seq_params) -> bool:
        config = self.config
        return (attention_mask is not None and attention_bias is None and packed_seq_params is None
                and self.softmax_offset is None and not config.apply_query_key_layer_scaling
                and (not self.training or self.attention_dropout.p == 0.0))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._fused(attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # megatron: [s, b, heads, hn] and a bool mask [b, 1, sq, sk], True = forbidden; SDPA: [b, heads, s, hn],
        # True = allowed.
        sq, b = query.shape[0], query.shape[1]
        allowed = ~attention_mask
        window = self.scale_mask_softmax.window_size
        if window is not None:  # (left, right); -1: unbounded. Queries are the last sq of the sk positions.
            sk = key.shape[0]
            rows = torch.arange(sk - sq, sk, device=allowed.device)[:, None]
            cols = torch.arange(sk, device=allowed.device)[None, :]
            band = torch.ones(sq, sk, dtype=torch.bool, device=allowed.device)
            if window[0] >= 0:
                band &= cols >= rows - window[0]
            if window[1] >= 0:
                band &= cols <= rows + window[1]
            allowed = allowed & band
        allowed = allowed | torch.eye(sq, key.shape[0], dtype=torch.bool, device=allowed.device)
        context = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), attn_mask=allowed,
            scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition)
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def use_sdpa_core_attention(layer_spec) -> None:
    """Put :class:`SDPACoreAttention` in every layer of a megatron layer spec (one layer's, or a decoder block's
    ``layer_specs``) whose core attention is megatron's local ``DotProductAttention``."""
    block = getattr(layer_spec, "layer_specs", None)  # a decoder block's TransformerBlockSubmodules
    layers = block if block is not None else [layer_spec]
    for layer in layers:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = SDPACoreAttention
