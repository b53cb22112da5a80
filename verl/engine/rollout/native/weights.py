"""HF safetensors checkpoint -> one rollout TP rank's rollout-layout tensors.

Only the slices this rank holds are read (``verl.models.hf_io.HFCheckpoint.slice``), and each lands
directly in the engine's flat buffer: q/k/v rows of the rank's heads (KV heads replicated when tp > kv heads),
gate/up rows of its FFN slice, o_proj/down_proj columns of its input slice, embed_tokens/lm_head
rows of its slice of the vocabulary padded to a multiple of 64 (padding rows are zero).
"""

from __future__ import annotations

import torch

from verl.hybrid_engine.rollout_layout import kv_head_of_rank, kv_heads_per_rank, padded_vocab_size
from verl.models.config import ModelConfig
from verl.models.hf_io import HFCheckpoint
from verl.utils.checkpoint import CheckpointError


def load_hf_checkpoint(model_dir: str, config: ModelConfig, tp_size: int, tp_rank: int,
                       views: dict[str, torch.Tensor]) -> None:
    """Fill ``views`` (rollout-layout name -> destination tensor) with rank ``tp_rank``'s slices."""
    write = views.__getitem__
    ckpt = HFCheckpoint(model_dir)
    unsupported = [n for n in ckpt.files if n.endswith(("o_proj.bias", "down_proj.bias", "gate_proj.bias",
                                                          "up_proj.bias"))]
    if unsupported:
        raise CheckpointError(
            f"HF checkpoint: the rollout layout has no o_proj/MLP biases, found {unsupported[0]} "
            "(attention_bias on Llama / mlp_bias are not supported)"
        )
    h, d = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    q_rows, kv_rows = heads // tp_size * d, kv_heads_per_rank(config, tp_size) * d
    q_start = tp_rank * q_rows
    kv_start = kv_head_of_rank(config, tp_size, tp_rank) * d
    ffn = config.intermediate_size // tp_size
    f_start = tp_rank * ffn
    vocab_rows = padded_vocab_size(config.vocab_size) // tp_size
    v_start = tp_rank * vocab_rows
    v_real = max(0, min(vocab_rows, config.vocab_size - v_start))  # rows of this slice inside the real vocab

    def vocab_table(dst: torch.Tensor, name: str) -> None:
        dst.zero_()
        if v_real:
            dst[:v_real].copy_(ckpt.slice(name, (config.vocab_size, h))[v_start:v_start + v_real])

    vocab_table(write("model.embed_tokens.weight"), "model.embed_tokens.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        write(p + "input_layernorm.weight").copy_(ckpt.slice(p + "input_layernorm.weight", (h,))[:])
        write(p + "post_attention_layernorm.weight").copy_(ckpt.slice(p + "post_attention_layernorm.weight", (h,))[:])
        qkv = write(a + "qkv_proj.weight")
        qkv[:q_rows].copy_(ckpt.slice(a + "q_proj.weight", (heads * d, h))[q_start:q_start + q_rows])
        qkv[q_rows:q_rows + kv_rows].copy_(ckpt.slice(a + "k_proj.weight", (kv * d, h))[kv_start:kv_start + kv_rows])
        qkv[q_rows + kv_rows:].copy_(ckpt.slice(a + "v_proj.weight", (kv * d, h))[kv_start:kv_start + kv_rows])
        if config.attention_bias:
            bias = write(a + "qkv_proj.bias")
            bias[:q_rows].copy_(ckpt.slice(a + "q_proj.bias", (heads * d,))[q_start:q_start + q_rows])
            bias[q_rows:q_rows + kv_rows].copy_(ckpt.slice(a + "k_proj.bias", (kv * d,))[kv_start:kv_start + kv_rows])
            bias[q_rows + kv_rows:].copy_(ckpt.slice(a + "v_proj.bias", (kv * d,))[kv_start:kv_start + kv_rows])
        write(a + "o_proj.weight").copy_(ckpt.slice(a + "o_proj.weight", (h, heads * d))[:, q_start:q_start + q_rows])
        gate_up = write(m + "gate_up_proj.weight")
        gate_up[:ffn].copy_(ckpt.slice(m + "gate_proj.weight", (config.intermediate_size, h))[f_start:f_start + ffn])
        gate_up[ffn:].copy_(ckpt.slice(m + "up_proj.weight", (config.intermediate_size, h))[f_start:f_start + ffn])
        write(m + "down_proj.weight").copy_(
            ckpt.slice(m + "down_proj.weight", (h, config.intermediate_size))[:, f_start:f_start + ffn])
    write("model.norm.weight").copy_(ckpt.slice("model.norm.weight", (h,))[:])
    if not config.tie_word_embeddings:
        vocab_table(write("lm_head.weight"), "lm_head.weight")
