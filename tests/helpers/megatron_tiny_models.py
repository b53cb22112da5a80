"""Tiny random Qwen2 / Llama checkpoints (and a Gemma 3 one for the block features), batches and an SFT loss hook
for the Megatron and FSDP multi-rank tests."""

from __future__ import annotations

import torch

from verl.models.config import ModelConfig

VOCAB = 200  # not a multiple of 128
SEQ, RESPONSE = 12, 4

# name -> HF config kwargs: GQA and MHA, tied and untied, qkv bias (Qwen2) and none (Llama).
TINY_CONFIGS = {
    "qwen2_gqa_tied": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2_mha_untied": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=4,
                             tie_word_embeddings=False),
    "llama_gqa_untied": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False),
    "llama_mha_tied": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4,
                           tie_word_embeddings=True),
}

# Gemma 3's block (ModelConfig.block_features): GeGLU, (1 + w) norms in float32, sandwich and q/k norms, embedding
# scale, sliding-window layers (window 3 < SEQ) with their own RoPE base, query_pre_attn_scalar != head_dim and
# soft-capped logits. Kept apart from TINY_CONFIGS, which many tests iterate.
BLOCK_CONFIGS = {
    "gemma3_sliding_softcap": dict(
        model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
        sliding_window=3, layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        final_logit_softcapping=5.0, tie_word_embeddings=True),
}
CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
           "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def hf_model(name: str, seed: int = 0):
    import transformers

    kwargs = dict({**TINY_CONFIGS, **BLOCK_CONFIGS}[name])
    model_type = kwargs.pop("model_type")
    config_cls, model_cls = (getattr(transformers, c) for c in CLASSES[model_type])
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager", **kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # HF zero-inits biases; random ones make the qkv-bias layout visible
        for pname, param in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_hf(model, out_dir: str, sharded: bool) -> str:
    model.save_pretrained(out_dir, max_shard_size="40KB" if sharded else "1GB")
    return out_dir


def model_config(hf_dir: str) -> ModelConfig:
    return ModelConfig.from_pretrained(hf_dir)


def padded_batch(seed: int = 1, batch: int = 4):
    """input_ids/attention_mask/position_ids/responses with left padding, right padding and both."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    attention_mask = torch.ones(batch, SEQ, dtype=torch.long)
    pads = [(0, 0), (3, 0), (0, 2), (2, 1)]
    for row in range(batch):
        left, right = pads[row % len(pads)]
        attention_mask[row, :left] = 0
        attention_mask[row, SEQ - right:] = 0
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "responses": input_ids[:, -RESPONSE:]}


def sft_loss(outputs, micro_batch):
    """Negative mean log-likelihood of the response tokens (a stand-in for the PPO loss hook)."""
    mask = micro_batch["response_mask"].float()
    loss = -(outputs["log_probs"] * mask).sum() / mask.sum()
    entropy = (outputs["entropy"] * mask).sum() / mask.sum()
    return loss, {"entropy": entropy}
