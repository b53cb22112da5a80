"""The sentiment workload's judge (issue 47, item 4) reads whole words: its tokenizer, loaded as the judge's engine
loads it (AutoTokenizer on a directory whose config.json says qwen2, which makes transformers rebuild it as
Qwen2Tokenizer from the file's vocabulary and merges), is one token per word and decodes back to the text."""

import json


def test_the_generated_judge_tokenizer_survives_transformers_qwen2_load(tmp_path):
    from transformers import Qwen2Config

    from verl.data.sentiment import JUDGE_CHAT_TEMPLATE, JUDGE_TEMPLATE, _rm_words, build_judge_tokenizer
    from verl.workers.reward_model.plan import load_tokenizer

    build_judge_tokenizer(str(tmp_path))
    vocab = len(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"])
    Qwen2Config(vocab_size=64 * ((vocab + 63) // 64), architectures=["Qwen2ForCausalLM"]).save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path), "reward_model.model.path")
    assert tok.chat_template == JUDGE_CHAT_TEMPLATE
    review = "the acting was great but the plot felt slow"
    text = tok.apply_chat_template([{"role": "user", "content": JUDGE_TEMPLATE.format(response=review)}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    words = [p.removeprefix("Ġ") for p in pieces if p not in ("Ġ", "<|user|>", "<|end|>", "<|assistant|>")]
    assert words == ["rate", ":", *review.split()]
    assert pieces[0] == "<|user|>" and pieces[-2:] == ["<|assistant|>", "Ġ"]
    assert tok.decode(ids, skip_special_tokens=True).split() == ["rate", ":", *review.split()]
    for word in _rm_words():  # every word the judge was trained on is one token (digits: the verdicts)
        assert len(tok(word if word.isdigit() else " " + word, add_special_tokens=False)["input_ids"]) == 1, word
    assert tok.eos_token == "<|end|>" and tok.pad_token == "<pad>"


def test_the_sentiment_test_prompts_name_films_no_training_prompt_names(tmp_path):
    # Issue 57 item 3: the held-out reviews are of films the policy never trained on, found from the written files.
    import pyarrow.parquet as pq

    from verl.data.sentiment import FILMS, write_sentiment

    write_sentiment(str(tmp_path), num_train=256, num_test=64, rm=False, judge=False)

    def films(split):
        rows = pq.read_table(tmp_path / f"{split}.parquet").to_pylist()
        texts = [row["prompt"][0]["content"] for row in rows]
        assert all(t.startswith("review of ") and t.endswith(" :") for t in texts)
        return {t.removeprefix("review of ").removesuffix(" :") for t in texts}

    train, test = films("train"), films("test")
    assert train and test and train | test <= set(FILMS)
    assert not train & test, train & test
