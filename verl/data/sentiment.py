"""The documents' PPO workload, made here: a sentiment task, a classifier reward model of another architecture and
tokenizer, and a generative judge, all built and trained on CPU (2.5 min on 2 cores under load ~24, one torch
thread).

``python -m verl.data.sentiment --out data/sentiment`` writes:

- ``train.parquet`` / ``test.parquet``: prompts ``review of <film> :`` (data_source ``sentiment``); the actor writes
  the review. The test prompts name films no training prompt names (:data:`TRAIN_FILMS` / :data:`TEST_FILMS`).
  ``reward_model.ground_truth`` is ``positive`` (what the reward asks for; a judge template may name it).
- ``tokenizer/``: the actor's word-level tokenizer (its own vocabulary order, eos ``</s>``).
- ``rm/``: a ``BertForSequenceClassification`` (num_labels=1) with its own word-level tokenizer (another vocabulary
  order, ``[CLS] prompt [SEP] response [SEP]``), trained here to score a text's sentiment: the regression target is
  the count of positive minus negative words (clipped to [-3, 3]) of random word sequences, so an untrained
  actor's babble is scored too.
- ``judge/``: a ``Qwen2ForCausalLM`` judge with the RM's words (a byte-level BPE in Qwen2's format, one token a
  word: see :func:`build_judge_tokenizer`) and a chat template, trained here to answer :data:`JUDGE_TEMPLATE` with
  one digit, 5 + that same count (clipped to [0, 9]); ``verl.workers.reward_judge.parse_verdict`` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Sequence

# The rule itself lives with the reward functions (the task's built-in scorer, what validation reports).
from verl.utils.reward_score.sentiment import NEGATIVE, POSITIVE, sentiment

NEUTRAL = ("the", "plot", "acting", "story", "music", "was", "and", "felt", "very", "quite", "ending", "cast",
           "script", "really", "but", "a", "it", "film", "scenes", "is")
FILMS = ("the sequel", "this movie", "the remake", "the western", "the musical", "the thriller", "the comedy",
         "the drama", "the cartoon", "the documentary", "the romance", "the heist")
# The actor trains on reviews of the first nine and is validated on the last three: a held-out prompt is one the
# policy never saw (the RM and the judge are trained on random texts about every film).
TRAIN_FILMS, TEST_FILMS = FILMS[:9], FILMS[9:]
PROMPT_WORDS = ("review", "of", ":", "sequel", "movie", "remake", "western", "musical", "thriller", "comedy", "drama",
                "cartoon", "documentary", "romance", "heist", "this")
WORDS = tuple(dict.fromkeys(POSITIVE + NEGATIVE + NEUTRAL + PROMPT_WORDS))
DATA_SOURCE = "sentiment"
JUDGE_TEMPLATE = "rate : {response}"
JUDGE_CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' <|end|> ' }}{% endfor %}"
                       "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")


def prompts(num: int, seed: int, split: str) -> list[dict]:
    """``num`` prompts of ``split`` ("train": the training films, otherwise the held-out ones)."""
    rng = random.Random(seed)
    films = TRAIN_FILMS if split == "train" else TEST_FILMS
    rows = []
    for i in range(num):
        prompt = f"review of {rng.choice(films)} :"
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": prompt}],
                     "ability": "sentiment", "reward_model": {"style": "model", "ground_truth": "positive"},
                     "extra_info": {"split": split, "index": i}})
    return rows


def _word_tokenizer(out_dir: str, words: Sequence[str], specials: dict[str, str], pair: bool = False,
                    chat_template: str | None = None) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(specials.values()))}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(dict.fromkeys(specials.values())))
    if pair:
        cls, sep = specials["cls_token"], specials["sep_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "model_max_length": 512,
              "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    return out_dir


def build_actor_tokenizer(out_dir: str) -> str:
    specials = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return _word_tokenizer(out_dir, WORDS, specials)


def _rm_words() -> list[str]:
    return sorted(WORDS) + [str(d) for d in range(10)] + ["rate"]  # another order than the actor's


def babble(rng: random.Random, max_words: int = 12) -> str:
    """A random word sequence, sometimes review-like: what an actor writes, from untrained to trained."""
    pool = POSITIVE + NEGATIVE + NEUTRAL if rng.random() < 0.7 else WORDS
    return " ".join(rng.choice(pool) for _ in range(rng.randint(0, max_words)))


def train_rm(out_dir: str, seed: int = 0, steps: int = 300, batch: int = 64) -> dict:
    """The BERT sentiment RM (see the module doc); returns its held-out correlation with the target."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    specials = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]"}
    _word_tokenizer(out_dir, _rm_words(), specials, pair=True)
    tok = AutoTokenizer.from_pretrained(out_dir)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2, num_labels=1,
                        pad_token_id=tok.pad_token_id, architectures=["BertForSequenceClassification"])
    model = BertForSequenceClassification(config)
    rng = random.Random(seed)

    def sample(n):
        pairs = [(f"review of {rng.choice(FILMS)} :", babble(rng)) for _ in range(n)]
        enc = tok([p for p, _ in pairs], [r for _, r in pairs], padding=True, return_tensors="pt")
        target = torch.tensor([max(-3, min(3, sentiment(r))) for _, r in pairs], dtype=torch.float32)
        return enc, target

    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        enc, target = sample(batch)
        loss = torch.nn.functional.mse_loss(model(**enc).logits[:, 0], target)
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    enc, target = sample(256)
    with torch.no_grad():
        pred = model(**enc).logits[:, 0]
    model.save_pretrained(out_dir)
    return {"rm_heldout_corr": float(torch.corrcoef(torch.stack([pred, target]))[0, 1])}


def build_judge_tokenizer(out_dir: str) -> None:
    """The judge's tokenizer: a byte-level BPE in Qwen2's own format (Qwen2's pre-tokenizer, every judge word one
    token, e.g. ``Ġgreat``), so that transformers' ``AutoTokenizer`` on the judge's directory -- which, beside a
    qwen2 ``config.json``, builds ``Qwen2Tokenizer`` from the file's vocabulary and merges whatever class the file
    names -- is the tokenizer the judge was trained with. (A word-level file is rebuilt there as a BPE without
    merges: every word falls apart into single characters and the judge reads noise.)"""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = ["<pad>", "<unk>", "<|end|>", "<s>", "<|user|>", "<|assistant|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
                                   r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    words = _rm_words()
    trainer = trainers.BpeTrainer(vocab_size=4096, min_frequency=1, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # Each word alone and after a space: both become single tokens.
    tokenizer.train_from_iterator([" ".join(words), *words, *(" " + w for w in words)], trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "pad_token": "<pad>", "unk_token": "<unk>", "eos_token": "<|end|>",
              "bos_token": None, "additional_special_tokens": ["<|user|>", "<|assistant|>"], "model_max_length": 512,
              "clean_up_tokenization_spaces": False, "chat_template": JUDGE_CHAT_TEMPLATE}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


def train_judge(out_dir: str, seed: int = 0, steps: int = 400, batch: int = 64) -> dict:
    """The Qwen2 judge (see the module doc): trained on its verdict token only; returns its held-out greedy
    verdict accuracy."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    build_judge_tokenizer(out_dir)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    vocab = raw.get_vocab_size()
    config = Qwen2Config(vocab_size=64 * ((vocab + 63) // 64), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=raw.token_to_id("<pad>"),
                         eos_token_id=raw.token_to_id("<|end|>"), bos_token_id=None,
                         architectures=["Qwen2ForCausalLM"])
    config.save_pretrained(out_dir)  # first: AutoTokenizer picks the tokenizer class from it, as a user's load will
    tok = AutoTokenizer.from_pretrained(out_dir)
    for word in _rm_words():  # the judge reads words, not characters (see build_judge_tokenizer)
        pieces = tok(word if word.isdigit() else " " + word, add_special_tokens=False)["input_ids"]  # Qwen2 splits
        # digits from the space before them: the verdict is the digit after "<|assistant|> "
        if len(pieces) != 1:
            raise RuntimeError(f"judge tokenizer: expected one token for {word!r} as {type(tok).__name__} loads "
                               f"it, found {tok.convert_ids_to_tokens(pieces)}")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    rng = random.Random(seed + 1)

    def prompt_ids(text: str) -> list[int]:
        rendered = tok.apply_chat_template([{"role": "user", "content": JUDGE_TEMPLATE.format(response=text)}],
                                           tokenize=False, add_generation_prompt=True)
        return tok(rendered, add_special_tokens=False)["input_ids"]

    def verdict(text: str) -> int:
        return max(0, min(9, 5 + sentiment(text)))

    def sample(n):
        rows = []
        for _ in range(n):
            text = babble(rng)
            ids = prompt_ids(text)
            rows.append((ids, tok(str(verdict(text)), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
        width = max(len(p) + len(v) for p, v in rows)
        ids = torch.full((n, width), tok.pad_token_id)
        labels = torch.full((n, width), -100)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, (p, v) in enumerate(rows):
            ids[i, :len(p) + len(v)] = torch.tensor(p + v)
            labels[i, len(p):len(p) + len(v)] = torch.tensor(v)
            mask[i, :len(p) + len(v)] = 1
        return ids, mask, labels

    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        ids, mask, labels = sample(batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    hits = 0
    checks = [babble(rng) for _ in range(64)]
    with torch.no_grad():
        for text in checks:
            ids = torch.tensor([prompt_ids(text)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            hits += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == str(verdict(text))
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return {"judge_heldout_accuracy": hits / len(checks)}


def write_sentiment(out: str, num_train: int = 256, num_test: int = 64, seed: int = 0, rm: bool = True,
                    judge: bool = True) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(prompts(num_train, seed, "train")), os.path.join(out, "train.parquet"))
    pq.write_table(pa.Table.from_pylist(prompts(num_test, seed + 1, "test")), os.path.join(out, "test.parquet"))
    build_actor_tokenizer(os.path.join(out, "tokenizer"))
    report: dict = {"train": num_train, "test": num_test}
    if rm:
        start = time.monotonic()
        report.update(train_rm(os.path.join(out, "rm"), seed))
        report["rm_train_s"] = time.monotonic() - start
    if judge:
        start = time.monotonic()
        report.update(train_judge(os.path.join(out, "judge"), seed))
        report["judge_train_s"] = time.monotonic() - start
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl.data.sentiment", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-test", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-rm", action="store_true", help="skip training the BERT reward model")
    parser.add_argument("--no-judge", action="store_true", help="skip training the Qwen2 judge")
    args = parser.parse_args(argv)
    import torch

    # One intra-op thread: these models are too small to gain from more, and on shared cores (2 cores, load ~30)
    # two threads ran the training 5-17x slower than one (each op waits for its descheduled twin).
    torch.set_num_threads(1)
    report = write_sentiment(args.out, args.num_train, args.num_test, args.seed, rm=not args.no_rm,
                             judge=not args.no_judge)
    print(f"sentiment: {args.num_train} train / {args.num_test} test prompts -> {args.out}; "
          + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items()
                      if k not in ("train", "test")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
