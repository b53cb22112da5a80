"""Estimated activation memory of one training micro-batch on one rank, with and without activation recompute.

What the backward pass keeps from the forward, per transformer layer and token, in elements of the activation
dtype (the accounting of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022, written for any MLP width and grouped KV heads): the attention block's norm input, QKV input and output,
attention output and projection input (``5h + 2 kv``), the attention scores and their softmax (``2 a s``, the
math path that CPU attention takes), and the MLP's norm input, FC1 input, gated FC1 output and activation output
(``2h + 3f``). Tensor parallelism divides the parts that are split over heads or the FFN; sequence parallelism
divides the rest too. The output layer adds the logits and their gradient in fp32 over the vocabulary shard.

Full recompute (``enable_gradient_checkpointing``) keeps each layer's input only and recomputes one layer at a
time in the backward. Dropout masks, allocator slack and the optimizer's temporaries are not counted: this is an
estimate for choosing recompute, not a bound.
"""

from __future__ import annotations

from verl.models.config import ModelConfig


def per_layer_elements_per_token(model: ModelConfig, seq_len: int, tp: int, sequence_parallel: bool) -> float:
    """Elements one layer keeps per token of a micro-batch (see the module doc)."""
    h = model.hidden_size
    # A MoE layer's tokens go through top-k experts: the widest of its MLPs and its dense one counts.
    f = max(model.intermediate_size, model.moe_intermediate_size * model.num_experts_per_tok) if model.is_moe \
        else model.intermediate_size
    heads, kv = model.num_attention_heads, model.num_key_value_heads * model.head_dim
    replicated = 7 * h  # norm inputs, QKV and FC1 inputs, projection input: whole on every TP rank
    split = 2 * kv + h + 3 * f + 2 * heads * seq_len  # QKV/FC outputs and the attention scores: over the heads/FFN
    return (replicated / tp if sequence_parallel else replicated) + split / tp


def activation_bytes(model: ModelConfig, *, micro_batch: int, seq_len: int, tp: int = 1, pp: int = 1,
                     sequence_parallel: bool = False, dtype_bytes: int = 4, recompute: bool = False) -> int:
    """Bytes the backward of one micro-batch of ``micro_batch`` sequences of ``seq_len`` tokens keeps on the
    fullest pipeline stage of a rank (the first: it also holds the embedding's output)."""
    tokens = micro_batch * seq_len
    layers = -(-model.num_hidden_layers // pp)
    layer = per_layer_elements_per_token(model, seq_len, tp, sequence_parallel) * tokens * dtype_bytes
    layer_input = model.hidden_size * tokens * dtype_bytes / (tp if sequence_parallel else 1)
    kept = layers * layer_input + layer if recompute else layers * layer
    logits = 2 * tokens * (model.vocab_size / tp) * 4  # fp32 logits and their gradient, on the last stage
    return int(kept + logits)
