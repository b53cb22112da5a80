"""Tiny random HF checkpoints and left padding, shared by the Megatron, native-rollout and SGLang tests.

Imported as `helpers.tiny_models`: pyproject's pytest `pythonpath` puts tests/ on sys.path; sglang_session.py (run
under .venv-sglang) adds it itself.
"""

import torch

# Qwen2: tied embeddings, qkv bias, vocab a multiple of 64 (no rollout padding).
# Llama: untied lm_head, vocab 300 (padded to 320 in the rollout layout, to 512 in Megatron's at TP2).
# Two KV heads: on CPU SGLang pads (not replicates) KV heads when tp > kv heads, see sglang_loader.
MODELS = {
    "qwen2": dict(model_type="qwen2", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama": dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}
# Gemma 3's block (sliding window 3 with its own RoPE base, sandwich and (1 + w) norms, GeGLU, embedding scale), kept
# apart from MODELS, which several tests iterate.
BLOCK_MODELS = {
    "gemma3": dict(model_type="gemma3_text", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                   sliding_window=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                   tie_word_embeddings=True),
}


def save_tiny_model(kind: str, path: str, seed: int = 0, **changes) -> str:
    """Write a random fp32 ``kind`` model (a key of MODELS or BLOCK_MODELS, with ``changes`` to its config) as an HF
    checkpoint at ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**{**MODELS, **BLOCK_MODELS}[kind], **changes}
    model_type = cfg.pop("model_type")
    # A wide init keeps the top logits apart, so greedy choices do not hinge on fp32 summation order.
    config = AutoConfig.for_model(model_type, max_position_embeddings=128, initializer_range=0.2,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=0, **cfg)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def left_pad(prompts, pad_id: int = 0):
    """Token-id lists -> (input_ids, attention_mask), both [B, longest], padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def alive_pids(pids):
    """The pids among ``pids`` that are still running (zombies count as gone)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def arithmetic_data_args(out, num_train: int = 64, num_test: int = 16) -> list:
    """The arithmetic task written to ``out`` by `verl data arithmetic`'s own entry point, run in this process
    (the same files as the command; the command line itself is tests/unit/test_bad_inputs.py's), as verl train's
    data overrides."""
    from verl.utils.dataset import arithmetic

    assert arithmetic.main(["--out", str(out), "--num-train", str(num_train), "--num-test", str(num_test)]) == 0
    return [f"data.train_files={out}/train.parquet", f"data.val_files={out}/test.parquet",
            f"data.tokenizer={out}/tokenizer"]


def write_arithmetic_data(out, num_train: int, num_test: int) -> list:
    """The arithmetic task written to ``out`` in this process (no CLI start: the unit tests' fixtures) as verl
    train's data overrides."""
    from verl.utils.dataset.arithmetic import build_char_tokenizer, generate_problems, make_row, write_parquet

    train, test = generate_problems(num_train, num_test, seed=0)
    write_parquet([make_row(p, "train", i) for i, p in enumerate(train)], str(out / "train.parquet"))
    write_parquet([make_row(p, "test", i) for i, p in enumerate(test)], str(out / "test.parquet"))
    build_char_tokenizer(str(out / "tokenizer"))
    return [f"data.train_files={out / 'train.parquet'}", f"data.val_files={out / 'test.parquet'}",
            f"data.tokenizer={out / 'tokenizer'}"]
