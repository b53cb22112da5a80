"""A tiny random chat checkpoint: helpers.tiny_models' qwen2 weights plus a character-level tokenizer whose
specials are ChatML's (``<|im_start|>``, ``<|im_end|>`` as eos) and a ChatML chat template, so text prompts,
chat rendering and eos handling run end to end in a second."""

from __future__ import annotations

import os
import string

from helpers.tiny_models import save_tiny_model

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]  # ids 0-3
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IM_END = SPECIALS.index("<|im_end|>")


def save_chat_tokenizer(path: str, chat_template: str | None = CHATML) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   bos_token=None, unk_token="<pad>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path


def save_chat_model(path: str, chat_template: str | None = CHATML, seed: int = 0, **changes) -> str:
    """qwen2 tiny weights (vocab 320 > the tokenizer's ~104 ids; ``changes`` to its config) with the chat tokenizer
    beside them."""
    save_tiny_model("qwen2", path, seed=seed, **changes)
    save_chat_tokenizer(path, chat_template)
    assert os.path.isfile(os.path.join(path, "tokenizer_config.json"))
    return path


def hf_chat_greedy(model_dir: str, messages: list[dict], new_tokens: int) -> str:
    """transformers, the oracle of the generation jobs: ``messages`` through the model's chat template with the
    generation prompt, greedy for ``new_tokens`` or up to the tokenizer's eos, decoded without special tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    return tok.decode(out, skip_special_tokens=True)
