"""Tiny classifier reward models of other families, each with its own character tokenizer (another vocabulary
order than the arithmetic actor's), built without a hub; and transformers' own score of a conversation."""

import json
import os

import torch

RM_CHARACTERS = list("abcdefghijklmnopqrstuvwxyz ") + list(reversed("0123456789+-=*/()\n"))
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<|user|>", "<|assistant|>", "<|end|>"]
# A chat template of the reward model's own (not the actor's): role markers and an end marker per message.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{{ m['content'] }}{{ '<|end|>' }}"
                 "{% endfor %}")
FAMILIES = ("llama", "qwen2", "deberta-v2", "bert")
ENCODERS = ("deberta-v2", "bert")


def save_rm_tokenizer(path: str, chat_template: str | None = CHAT_TEMPLATE, pair_template: bool = False) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in RM_CHARACTERS:
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIALS)
    if pair_template:  # BERT's [CLS] A [SEP] B [SEP] with segment ids
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    os.makedirs(path, exist_ok=True)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "unk_token": "[UNK]",
              "cls_token": "[CLS]", "sep_token": "[SEP]", "model_max_length": 512,
              "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh)
    return path


def rm_config(family: str, num_labels: int = 1, max_positions: int = 128):
    import transformers

    vocab = len(SPECIALS) + len(RM_CHARACTERS)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=max_positions, num_labels=num_labels,
                  pad_token_id=0)
    if family == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, initializer_range=0.3, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=2, initializer_range=0.3, **common)
    if family == "deberta-v2":
        return transformers.DebertaV2Config(type_vocab_size=2, initializer_range=0.3, relative_attention=True,
                                            position_buckets=16, pos_att_type=["p2c", "c2p"], **common)
    if family == "bert":
        return transformers.BertConfig(type_vocab_size=2, initializer_range=0.3, **common)
    raise ValueError(family)


def save_reward_model(path: str, family: str, seed: int = 0, num_labels: int = 1, max_positions: int = 128,
                      chat_template: str | None = CHAT_TEMPLATE):
    """A tiny random ``*ForSequenceClassification`` of ``family`` and its tokenizer at ``path``: the model (eval).
    Encoders get a pair post-processor and no chat template."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(rm_config(family, num_labels, max_positions)).eval()
    model.save_pretrained(path)
    if family in ENCODERS:
        save_rm_tokenizer(path, chat_template=None, pair_template=True)
    else:
        save_rm_tokenizer(path, chat_template=chat_template)
    return model


def hf_score(model, tokenizer, prompt: str, response: str, family: str, max_length: int | None = None) -> float:
    """transformers' own forward of the conversation as the RM reads it, built here by hand: the chat template
    (decoders) or [CLS] prompt [SEP] response [SEP] (encoders), the prompt cut from the left to max_length."""
    if family in ENCODERS:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"]
        specials = 3 if response else 2
        if max_length is not None and len(p) + len(r) + specials > max_length:
            p = p[len(p) - (max_length - len(r) - specials):]
        ids = [tokenizer.cls_token_id] + p + [tokenizer.sep_token_id]
        types = [0] * len(ids)
        if response:  # transformers reads an empty second text as no pair
            ids += r + [tokenizer.sep_token_id]
            types += [1] * (len(r) + 1)
        inputs = {"input_ids": torch.tensor([ids]), "token_type_ids": torch.tensor([types])}
    else:
        text = f"<|user|>{prompt}<|end|><|assistant|>{response}<|end|>"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if max_length is not None:
            ids = ids[-max_length:]
        inputs = {"input_ids": torch.tensor([ids])}
    with torch.no_grad():
        return float(model(**inputs).logits[0, 0])
