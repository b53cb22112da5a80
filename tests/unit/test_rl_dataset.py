"""Arithmetic task generation, the char tokenizer (via AutoTokenizer), RLHFDataset, sampler, GSM8K preprocessing."""

import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from verl.protocol import DataProto
from verl.utils.dataset import arithmetic, gsm8k
from verl.utils.dataset.errors import DatasetError
from verl.utils.dataset.rl_dataset import ResumableSampler, RLHFDataset, collate_fn, create_rl_sampler


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    assert (
        arithmetic.main(["--out", str(out), "--num-train", "40", "--num-test", "12", "--seed", "3", "--ops", "+-"]) == 0
    )
    return out


@pytest.fixture(scope="module")
def tokenizer(data_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(data_dir / "tokenizer"))


# ----------------------------------------------------------------------------- task + tokenizer
def test_arithmetic_splits_are_disjoint_seeded_and_correct(data_dir):
    train = pq.read_table(data_dir / "train.parquet").to_pylist()
    test = pq.read_table(data_dir / "test.parquet").to_pylist()
    assert len(train) == 40 and len(test) == 12
    train_prompts = {r["prompt"][0]["content"] for r in train}
    assert not train_prompts & {r["prompt"][0]["content"] for r in test}
    for row in train + test:
        assert row["data_source"] == "arithmetic" and row["prompt"][0]["role"] == "user"
        expression = row["prompt"][0]["content"]
        assert expression.endswith("=")
        a, op, b = (expression[:2], expression[2], expression[3:5])
        assert row["reward_model"]["ground_truth"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
    again, _ = arithmetic.generate_problems(40, 12, seed=3, ops="+-")
    assert [arithmetic.make_row(p, "train", i) for i, p in enumerate(again)] == train
    other, _ = arithmetic.generate_problems(40, 12, seed=4, ops="+-")
    assert other != again


def _computation(prompt: str) -> tuple:
    """What ``a+b=`` / ``a-b=`` computes, read from the prompt: addition commutes (``37+48=`` is ``48+37=``)."""
    a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", prompt).groups()
    return (op, *sorted((int(a), int(b)))) if op == "+" else (op, int(a), int(b))


@pytest.mark.parametrize("num_train, num_test, seed, ops", [(4000, 256, 0, "+"), (3000, 300, 7, "+-")])
def test_arithmetic_held_out_problems_are_held_out_by_computation(num_train, num_test, seed, ops):
    # The quickstart's split (4000 / 256, seed 0) had 120 held-out problems whose commuted twin was trained on.
    train, test = arithmetic.generate_problems(num_train, num_test, seed=seed, ops=ops)
    assert len(train) == num_train and len(test) == num_test and len(set(train)) == num_train
    prompt = lambda p: arithmetic.make_row(p, "x", 0)["prompt"][0]["content"]  # noqa: E731
    held_out = [_computation(prompt(p)) for p in test]
    assert len(set(held_out)) == num_test  # each held-out computation once
    assert not set(held_out) & {_computation(prompt(p)) for p in train}
    if "-" in ops:  # a-b and b-a are two computations: both may be drawn
        assert any((a, "-", b) in train and (b, "-", a) in train for a, op, b in train if op == "-")


def test_arithmetic_out_of_form_problems_are_a_form_training_never_shows(tmp_path):
    assert arithmetic.main(["--out", str(tmp_path), "--num-train", "4000", "--num-test", "256",
                            "--num-test-ood", "100"]) == 0
    rows = {split: pq.read_table(tmp_path / f"{split}.parquet").to_pylist() for split in ("train", "test", "test_ood")}
    digits = lambda row: sorted(len(n) for n in re.findall(r"\d+", row["prompt"][0]["content"]))  # noqa: E731
    assert {tuple(digits(r)) for r in rows["train"] + rows["test"]} == {(2, 2)}
    shapes = [tuple(digits(r)) for r in rows["test_ood"]]
    assert len(shapes) == 100 and set(shapes) == {(1, 2), (2, 3)} and shapes.count((1, 2)) == 50
    assert len({r["prompt"][0]["content"] for r in rows["test_ood"]}) == 100
    trained = {_computation(r["prompt"][0]["content"]) for r in rows["train"]}
    for row in rows["test_ood"]:
        assert row["extra_info"]["out_of_form"] is True and row["data_source"] == "arithmetic"
        assert _computation(row["prompt"][0]["content"]) not in trained
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", row["prompt"][0]["content"]).groups()
        assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))
        assert len(row["prompt"][0]["content"]) <= 8  # the arithmetic configs' max_prompt_length
    assert not any(r["extra_info"].get("out_of_form") for r in rows["train"] + rows["test"])
    # 9 one-digit and 900 three-digit partners for each of 90 two-digit operands, either order.
    with pytest.raises(DatasetError, match="at most 163620 out-of-form"):
        arithmetic.generate_out_of_form(163621)


def test_arithmetic_rejects_bad_options():
    with pytest.raises(DatasetError, match=r"expected ops made of '\+' and '-', found '\*'"):
        arithmetic.generate_problems(10, 10, ops="*")
    with pytest.raises(DatasetError, match="num_train \\+ num_test <= 8100"):
        arithmetic.generate_problems(8000, 200)


def test_char_tokenizer_round_trips_through_auto_tokenizer(tokenizer, data_dir):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert 20 <= len(tokenizer) <= 32
    text = "".join(arithmetic.CHARACTERS)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    assert (
        tokenizer.decode([tokenizer.bos_token_id] + ids[:3] + [tokenizer.eos_token_id], skip_special_tokens=True)
        == "012"
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (data_dir / "tokenizer" / name).is_file()


# ----------------------------------------------------------------------------- RLHFDataset
@pytest.fixture()
def mixed_parquet(tmp_path):
    """Three short prompts and one of 11 characters."""
    rows = [arithmetic.make_row(p, "train", i) for i, p in enumerate([(12, "+", 34), (50, "-", 61), (99, "+", 10)])]
    long_row = arithmetic.make_row((10, "+", 10), "train", 3)
    long_row["prompt"] = [{"role": "system", "content": "1+1="}, {"role": "user", "content": "12+34=+"}]
    path = tmp_path / "mixed.parquet"
    arithmetic.write_parquet(rows + [long_row], str(path))
    return str(path)


def test_item_is_left_padded_with_positions(tokenizer, mixed_parquet):
    ds = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 8})
    item = ds[0]  # "12+34=" is 6 tokens -> 2 pads on the left
    assert item["attention_mask"].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert item["position_ids"].tolist() == [0, 0, 0, 1, 2, 3, 4, 5]
    assert item["input_ids"][:2].tolist() == [tokenizer.pad_token_id] * 2
    assert tokenizer.decode(item["input_ids"], skip_special_tokens=True) == "12+34="
    assert tokenizer.decode(item["raw_prompt_ids"]) == "12+34="
    assert item["reward_model"]["ground_truth"] == "46" and item["data_source"] == "arithmetic"
    assert item["index"] == 0


def test_messages_are_concatenated_without_template_and_templated_with_one(tokenizer, mixed_parquet):
    ds = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 16})
    assert ds.prompt_text(ds.rows[3]) == "1+1=12+34=+"
    templated = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    templated.chat_template = (
        "{% for m in messages %}({{ m['content'] }}){% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    ds = RLHFDataset(mixed_parquet, templated, {"max_prompt_length": 16})
    assert templated.decode(ds[0]["raw_prompt_ids"]) == "(12+34=)="


def test_truncation_modes(tokenizer, mixed_parquet):
    # The long prompt is "1+1=12+34=+" (11 tokens) against max_prompt_length 6.
    left = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 6, "truncation": "left"})[3]
    assert tokenizer.decode(left["input_ids"]) == "2+34=+"
    right = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 6, "truncation": "right"})[3]
    assert tokenizer.decode(right["input_ids"]) == "1+1=12"
    assert right["attention_mask"].sum() == 6
    strict = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 6, "truncation": "error"})
    with pytest.raises(DatasetError, match="prompt 3 has 11 tokens, expected <= max_prompt_length=6"):
        strict[3]
    middle = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 6, "truncation": "middle"})[3]
    assert tokenizer.decode(middle["input_ids"]) == "1+14=+"  # the first and last 3 tokens, as verl
    with pytest.raises(
        DatasetError, match=r"data.truncation: expected one of \['error', 'left', 'right', 'middle'\], found 'mid'"
    ):
        RLHFDataset(mixed_parquet, tokenizer, {"truncation": "mid"})


def test_check_finds_bad_rows_before_training_and_names_file_and_row(tokenizer, mixed_parquet, tmp_path):
    strict = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 6, "truncation": "error"})
    with pytest.raises(DatasetError, match=r"mixed.*row 3: expected a prompt of <= data.max_prompt_length=6 tokens, "
                                           r"found 11"):
        strict.check()
    RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 6, "truncation": "left"}).check()
    with pytest.raises(DatasetError, match=r"expected at least 100 rows \(one batch\), found"):
        RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 64}).check(min_rows=100)
    huge = tmp_path / "huge.parquet"
    arithmetic.write_parquet([{"prompt": "7" * (1 << 20), "data_source": "arithmetic",
                               "reward_model": {"ground_truth": "1"}}], str(huge))
    with pytest.raises(DatasetError, match=r"huge.parquet row 0: .* found 1048576 characters"):
        RLHFDataset(str(huge), tokenizer, {"max_prompt_length": 8}).check()  # no tokenizing: instant


def test_filter_overlong_prompts_counts_and_reports(tokenizer, mixed_parquet, caplog):
    with caplog.at_level("WARNING", logger="verl"):
        ds = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 6, "filter_overlong_prompts": True})
    assert len(ds) == 3 and ds.num_filtered == 1
    assert "filtered 1 prompts longer than max_prompt_length=6; 3 remain" in caplog.text


def test_max_samples_keeps_the_first_rows_without_shuffle(tokenizer, data_dir):
    path = str(data_dir / "train.parquet")
    every = RLHFDataset(path, tokenizer, {"max_prompt_length": 8, "shuffle": False})
    first = RLHFDataset(path, tokenizer, {"max_prompt_length": 8, "shuffle": False}, max_samples=7)
    assert len(every) == 40 and first.rows == every.rows[:7]
    for no_limit in (-1, 0, 40, 1000):  # -1 / 0: every row (verl); at least the row count: every row
        assert len(RLHFDataset(path, tokenizer, {"shuffle": False}, max_samples=no_limit)) == 40


def test_max_samples_with_shuffle_is_a_seeded_random_subset_as_verl(tokenizer, data_dir):
    path = str(data_dir / "train.parquet")
    every = RLHFDataset(path, tokenizer, {"max_prompt_length": 8})
    pick = [RLHFDataset(path, tokenizer, {"shuffle": True, "seed": seed}, max_samples=10) for seed in (1, 1, 2)]
    assert pick[0].rows == pick[1].rows  # every rank draws the same rows
    assert pick[0].rows != pick[2].rows
    origin = pick[0]._origin
    assert len(set(origin)) == 10 and origin != list(range(10)) and origin != sorted(origin)
    assert pick[0].rows == [every.rows[i] for i in origin]


def test_max_samples_applies_before_the_filter_and_check_names_the_original_row(tokenizer, mixed_parquet, tmp_path):
    # Rows 0-2 are short, row 3 is 11 tokens. The first 2 rows: nothing to filter, one short of a batch of 3.
    ds = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 6, "filter_overlong_prompts": True},
                     max_samples=2)
    assert len(ds) == 2 and ds.num_filtered == 0
    with pytest.raises(DatasetError, match=r"expected at least 3 rows \(one batch\), found 2 after "
                                           r"max_samples=2 of 4 rows$"):
        ds.check(min_rows=3)
    both = RLHFDataset(mixed_parquet, tokenizer, {"max_prompt_length": 6, "filter_overlong_prompts": True},
                       max_samples=3)
    with pytest.raises(DatasetError, match="found 3 after max_samples=3 of 4 rows$"):
        both.check(min_rows=4)
    # A random subset still names the bad row by its file and row.
    rows = [arithmetic.make_row((i, "+", 1), "train", i) for i in range(6)]
    path = tmp_path / "six.parquet"
    arithmetic.write_parquet(rows, str(path))
    config = {"shuffle": True, "seed": 0}
    picked = RLHFDataset(str(path), tokenizer, config, max_samples=3)._origin  # depends on the count and seed only
    bad = picked[1]
    assert bad != 1, "the subset's second row must come from elsewhere in the file for this test to mean anything"
    rows[bad]["reward_model"] = {"ground_truth": None}
    arithmetic.write_parquet(rows, str(path))
    with pytest.raises(DatasetError, match=rf"six.parquet row {bad}: reward_model.ground_truth"):
        RLHFDataset(str(path), tokenizer, config, max_samples=3).check()


def test_missing_columns_and_files_are_reported(tokenizer, tmp_path):
    path = tmp_path / "bad.parquet"
    arithmetic.write_parquet([{"prompt": [{"role": "user", "content": "1+1="}]}], str(path))
    with pytest.raises(DatasetError, match=r"expected columns \[.data_source., .reward_model.\]"):
        RLHFDataset(str(path), tokenizer)
    with pytest.raises(DatasetError, match="expected a parquet file, found unreadable data"):
        RLHFDataset(str(tmp_path / "missing.parquet"), tokenizer)


def test_collate_into_dataproto(tokenizer, data_dir):
    ds = RLHFDataset(str(data_dir / "train.parquet"), tokenizer, {"max_prompt_length": 8})
    batch = DataProto.from_single_dict(collate_fn([ds[0], ds[1], ds[2]]))
    assert batch.batch["input_ids"].shape == (3, 8) and batch.batch["input_ids"].dtype == torch.long
    assert batch.non_tensor_batch["reward_model"].dtype == object and len(batch.non_tensor_batch["raw_prompt_ids"]) == 3
    batch.check_consistency(producer="dataloader")


# ----------------------------------------------------------------------------- sampler
def _loader(ds, sampler):
    return DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=collate_fn, drop_last=True)


def test_sampler_is_seeded_and_reshuffles_each_epoch():
    a, b = ResumableSampler(10, seed=7), ResumableSampler(10, seed=7)
    first = list(a)
    assert first == list(b) and sorted(first) == list(range(10))
    assert list(a) != first and a.epoch == 2  # epoch 1 uses another permutation
    assert list(ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]


def test_sampler_resume_matches_uninterrupted_run(tokenizer, data_dir):
    ds = RLHFDataset(str(data_dir / "train.parquet"), tokenizer, {"max_prompt_length": 8})
    config = {"shuffle": True, "seed": 5}

    def uids(batch):
        return [r["ground_truth"] + str(i) for r, i in zip(batch["reward_model"], batch["index"], strict=False)]

    reference = []
    sampler = create_rl_sampler(config, ds)
    for _ in range(2):  # two epochs of 10 batches
        reference += [uids(b) for b in _loader(ds, sampler)]

    sampler = create_rl_sampler(config, ds)
    resumed, it = [], iter(_loader(ds, sampler))
    for _ in range(13):  # into the second epoch
        try:
            resumed.append(uids(next(it)))
        except StopIteration:
            it = iter(_loader(ds, sampler))
            resumed.append(uids(next(it)))
    state = json.loads(json.dumps(sampler.state_dict()))  # must survive a checkpoint round trip
    fresh = create_rl_sampler(config, ds)
    fresh.load_state_dict(state)
    resumed += [uids(b) for b in _loader(ds, fresh)]
    assert resumed == reference

    with pytest.raises(DatasetError, match="expected seed=6 .* found 5 in the checkpoint"):
        create_rl_sampler({"seed": 6}, ds).load_state_dict(state)


# ----------------------------------------------------------------------------- gsm8k
def test_gsm8k_preprocess(tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(
        json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"})
        + "\n\n"
        + json.dumps({"question": "Big?", "answer": "#### 1,200"})
        + "\n"
    )
    assert gsm8k.main(["--input", str(raw), "--out", str(tmp_path / "out")]) == 0
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1200"]
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["prompt"][0]["content"].startswith("Tom has 3 apples") and "####" in rows[0]["prompt"][0]["content"]


@pytest.mark.parametrize(
    "content,message",
    [
        ("not json\n", "raw.jsonl:1: expected a JSON object, found invalid JSON"),
        ('{"question": "q"}\n', r"raw.jsonl:1: expected keys 'question' and 'answer', found \['question'\]"),
        ('{"question": "q", "answer": "seven"}\n', "record 0: expected '#### <number>' in 'answer', found none"),
        ("", "expected at least one record"),
    ],
)
def test_gsm8k_bad_input_is_one_clear_error(tmp_path, content, message):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(content)
    with pytest.raises(DatasetError, match=message):
        gsm8k.main(["--input", str(raw), "--out", str(tmp_path / "out")])
    with pytest.raises(DatasetError, match="expected an input jsonl file, found nothing"):
        gsm8k.main(["--input", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "out")])


def test_validation_reports_the_out_of_form_set_apart(data_dir, tokenizer):
    from verl.trainer.ppo.validation import is_out_of_form, val_score_metrics

    # Both held-out files through the dataset and collate, as the trainer's val dataloader reads them.
    ds = RLHFDataset([str(data_dir / "test.parquet"), str(data_dir / "test_ood.parquet")], tokenizer,
                     {"max_prompt_length": 8})
    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(len(ds))]))
    apart = is_out_of_form(batch)
    assert apart == [False] * 12 + [True] * 128
    # Right on 9 of the 12 in-distribution rows, on 32 of the 128 out-of-form rows.
    score = torch.tensor([1.0] * 9 + [0.0] * 3 + [1.0] * 32 + [0.0] * 96)
    metrics = val_score_metrics(score, batch.non_tensor_batch["data_source"].tolist(), apart)
    assert metrics == {"val/accuracy": 0.75, "val/num_samples": 12.0, "val/accuracy_out_of_form": 0.25,
                       "val/num_samples_out_of_form": 128.0, "val-core/arithmetic/reward/mean@1": 0.75}
    # Only in-distribution rows: as before, no out-of-form keys; only out-of-form rows: val/accuracy covers them.
    assert val_score_metrics(score[:12], ["arithmetic"] * 12, apart[:12]) == {
        "val/accuracy": 0.75, "val/num_samples": 12.0, "val-core/arithmetic/reward/mean@1": 0.75}
    only = val_score_metrics(score[12:], ["arithmetic"] * 128, apart[12:])
    assert only["val/accuracy"] == only["val/accuracy_out_of_form"] == 0.25 and only["val/num_samples"] == 128.0
    rows = DataProto.from_single_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long),
                                       "extra_info": np.array([None, {"index": 1}], dtype=object)})
    assert is_out_of_form(rows) == [False, False]
