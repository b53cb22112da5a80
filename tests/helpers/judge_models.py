"""A tiny generative judge (a random Qwen2 causal LM with the character tokenizer of helpers.reward_models, an
end-of-message token as its eos) built without a hub, and transformers' own greedy verdict for a prompt."""

import json
import os

import torch

from helpers.reward_models import CHAT_TEMPLATE, RM_CHARACTERS, SPECIALS, save_rm_tokenizer

# The chat template plus the assistant turn's opening when a generation prompt is asked for.
JUDGE_CHAT_TEMPLATE = CHAT_TEMPLATE + "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"


def save_judge(path: str, seed: int = 0, chat_template: str | None = JUDGE_CHAT_TEMPLATE):
    """A random ``Qwen2ForCausalLM`` judge and its tokenizer at ``path`` (eos: ``<|end|>``); returns the model."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    vocab = len(SPECIALS) + len(RM_CHARACTERS)
    eos = SPECIALS.index("<|end|>")
    config = Qwen2Config(vocab_size=64 * ((vocab + 63) // 64), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.2, pad_token_id=0, eos_token_id=eos,
                         bos_token_id=None, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    save_rm_tokenizer(path, chat_template=chat_template)
    cfg_file = os.path.join(path, "tokenizer_config.json")
    with open(cfg_file) as fh:
        tok_cfg = json.load(fh)
    tok_cfg["eos_token"] = "<|end|>"
    with open(cfg_file, "w") as fh:
        json.dump(tok_cfg, fh)
    return model


def hf_greedy_verdict(model, tokenizer, prompt_ids, max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt_ids`` up to and including eos, at most ``max_new_tokens``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                   dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
