"""The generated GSM8K-format word problems (verl data word-problems), their scorer, and the quickstart's
real-model path (no SFT stage for a pretrained checkpoint) up to its first stage."""

import os
import random
import re

import pyarrow.parquet as pq
import pytest

from launch import quickstart
from verl.cli import main as verl_main
from verl.utils.dataset.errors import DatasetError
from verl.utils.dataset.word_problems import (
    ITEMS,
    NAMES,
    OOD_ITEMS,
    OOD_NAMES,
    OOD_TEMPLATES,
    TEMPLATES,
    computation_key,
    fewshot_shots,
    generate_problems,
    kind_of,
    make_row,
)
from verl.utils.reward_score import default_compute_score, load_reward_fn
from verl.utils.reward_score.word_problems import compute_score, extract_answer


def _evaluate_solution(solution: str) -> int:
    """The worked solution's steps ("a op b = c.") recomputed; returns the last result."""
    result = None
    for a, op, b, c in re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)\.", solution):
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b), "/": int(a) / int(b)}[op]
        assert value == int(c), solution
        result = int(c)
    assert result is not None, solution
    return result


def test_every_template_states_a_question_whose_worked_solution_gives_its_answer():
    rng = random.Random(3)
    for template in TEMPLATES:
        for _ in range(200):
            question, solution, answer = template(rng, "Tom", "he", "apples")
            assert question.endswith("?") and "Tom" in question
            assert _evaluate_solution(solution) == answer
            assert 0 < answer < 100  # small numbers: the task is sized for a 135M model


def _computation(question: str) -> str:
    """The question with every name, pronoun and item replaced by a placeholder: what is left is the template's
    wording and the operands, which is what a problem computes (the issue's test: name and item don't count)."""
    names = [n for n, _ in NAMES + OOD_NAMES]
    text = re.sub(r"\b(" + "|".join(names) + r")\b", "<NAME>", question)
    text = re.sub(r"\b(he|she|He|She)\b", "<PRONOUN>", text)
    return re.sub(r"\b(" + "|".join(ITEMS + OOD_ITEMS) + r")\b", "<ITEM>", text, flags=re.IGNORECASE)


def test_splits_are_seeded_and_disjoint_by_computation_not_only_by_text():
    train, test = generate_problems(300, 40, seed=5)
    assert len(train) == 300 and len(test) == 40
    assert len({q for q, _, _ in train}) == 300
    train_computations = {_computation(q) for q, _, _ in train}
    test_computations = [_computation(q) for q, _, _ in test]
    assert len(set(test_computations)) == 40  # no held-out computation counted twice
    assert not train_computations & set(test_computations)
    # Their worked solutions (the operations, step by step) tell the same: none of the test's is trained on.
    assert not {s for _, s, _ in train} & {s for _, s, _ in test}
    assert generate_problems(300, 40, seed=5) == (train, test)
    assert generate_problems(900, 40, seed=5)[1] == test
    assert generate_problems(300, 40, seed=6)[1] != test
    with pytest.raises(DatasetError, match="num_test >= 1"):
        generate_problems(10, 0)


def test_kinds_draw_only_the_named_templates_and_leave_the_default_draws_as_they_were(tmp_path, capsys):
    """--kinds (the base model's task: one-step addition and subtraction): every split, the out-of-form one included,
    draws only those templates, still disjoint by computation; without it a seed's problems are what they were."""
    kinds = ("gets_more", "loses_some")
    train, test, ood = generate_problems(300, 40, seed=2, num_test_ood=20, kinds=kinds)
    ops = {re.sub(r"[^-+*/]", "", s) for _, s, _ in train + test + ood}
    assert ops == {"+", "-"}  # both kinds drawn, nothing else (one operation a problem)
    assert not {_computation(q) for q, _, _ in train} & {_computation(q) for q, _, _ in test}
    keys = {computation_key(t, s) for t in (0, 1) for _, s, _ in test}
    assert not keys & {computation_key(t, s) for t in (0, 1) for _, s, _ in train}
    assert generate_problems(300, 40, seed=2, num_test_ood=20, kinds=None) == generate_problems(300, 40, 2, 20)
    every_kind = [t.kind for t in TEMPLATES]
    assert generate_problems(300, 40, 2, 20, kinds=every_kind) == generate_problems(300, 40, 2, 20)  # all, in order
    for bad in (("gets_more", "bogus"), (), ("bags", "bags")):
        with pytest.raises(DatasetError, match="expected distinct kinds among gets_more"):
            generate_problems(10, 2, kinds=bad)
    assert verl_main(["data", "word-problems", "--out", str(tmp_path), "--num-train", "20", "--num-test", "8",
                      "--num-test-ood", "4", "--kinds", "loses_some"]) == 0
    rows = [r for split in ("train", "test", "test_ood")
            for r in pq.read_table(tmp_path / f"{split}.parquet").to_pylist()]
    assert len(rows) == 32 and all(" - " in r["extra_info"]["answer"] for r in rows)
    assert verl_main(["data", "word-problems", "--out", str(tmp_path / "x"), "--kinds", "lose_some"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "found lose_some" in err[0]
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_with_kinds_the_fewshot_prompt_works_one_problem_of_each_kind(tmp_path):
    """Two same-kind shots make the base model copy their operation into every problem (Gemma 3 270M wrote
    "2 - 9 = -10" for "gets 9 more" after two subtraction shots): with --kinds, the shots are the first training
    problem of each kind, in the order named."""
    rng = random.Random(4)
    for template, twin in zip(TEMPLATES, OOD_TEMPLATES, strict=True):
        assert kind_of(template(rng, "Tom", "he", "pens")[0]) == template.kind
        assert kind_of(twin(rng, "Omar", "he", "coins")[0]) is None  # reworded: no training wording
    assert verl_main(["data", "word-problems", "--out", str(tmp_path), "--num-train", "40", "--num-test", "8",
                      "--num-test-ood", "0", "--kinds", "loses_some,gets_more", "--prompt-format", "fewshot"]) == 0
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    shots = train[0]["prompt"].split("\n\n")[:-1]
    assert [kind_of(shot.split("\n")[0].removeprefix("Question: ")) for shot in shots] == ["loses_some", "gets_more"]
    first = {kind: next(r for r in train if kind_of(r["extra_info"]["question"]) == kind)
             for kind in ("loses_some", "gets_more")}
    assert [shot.split("\n")[0] for shot in shots] == [f"Question: {first[k]['extra_info']['question']}"
                                                         for k in ("loses_some", "gets_more")]
    problems = generate_problems(60, 4, seed=1)[0]
    assert fewshot_shots(problems, None) == tuple(problems[:2])  # the default job's prompts are as they were
    assert fewshot_shots(problems, None, 3) == tuple(problems[:3])
    # One shot: the first kind's first problem (the Gemma 3 task: one worked subtraction, problems of both kinds)
    (shot,) = fewshot_shots(problems, ("loses_some", "gets_more"), 1)
    assert shot == next(p for p in problems if kind_of(p[0]) == "loses_some")
    three = fewshot_shots(problems, ("bags", "share"), 3)
    assert [kind_of(p[0]) for p in three] == ["bags", "share", "bags"] and three[0] != three[2]
    with pytest.raises(DatasetError, match="expected 1 training problem.* of kind gets_more for the shots, found 0"):
        fewshot_shots([p for p in problems if kind_of(p[0]) != "gets_more"], ("gets_more",))
    with pytest.raises(DatasetError, match="num_shots >= 1, found 0"):
        fewshot_shots(problems, None, 0)
    assert verl_main(["data", "word-problems", "--out", str(tmp_path / "one"), "--num-train", "40", "--num-test", "8",
                      "--kinds", "loses_some,gets_more", "--num-shots", "1", "--prompt-format", "fewshot"]) == 0
    one = pq.read_table(tmp_path / "one" / "test.parquet").to_pylist()
    assert all(r["prompt"].count("Question: ") == 2 and r["prompt"].count(" - ") == 1 for r in one)
    assert verl_main(["data", "word-problems", "--out", str(tmp_path / "chat"), "--num-shots", "1"]) == 2
    assert not (tmp_path / "chat").exists()  # a chat prompt has no shots: refused, nothing written


@pytest.mark.parametrize("flag, value", [("--problem-kinds", "gets_more"), ("--num-shots", "1")])
def test_the_quickstart_refuses_word_problem_shapes_for_the_arithmetic_task(tmp_path, capsys, flag, value):
    assert quickstart.main(["--out", str(tmp_path / "q"), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "arithmetic" in err[0]
    assert not (tmp_path / "q").exists()


def test_the_default_job_split_holds_out_every_computation():
    # The real-model job's split (verl data word-problems' defaults): 51 of its 64 held-out problems had a
    # training row with the same template and operands before the split was drawn by computation.
    train, test, ood = generate_problems(2000, 64, seed=0, num_test_ood=64)
    assert generate_problems(2000, 64, seed=0)[1] == test  # asking for the out-of-form set leaves it as it was
    seen = {_computation(q) for q, _, _ in train}
    assert [q for q, _, _ in test if _computation(q) in seen] == []


def test_the_out_of_form_set_is_worded_named_and_stocked_as_training_never_is():
    train, test, ood = generate_problems(2000, 64, seed=0, num_test_ood=64)
    assert len(ood) == 64 and len({_computation(q) for q, _, _ in ood}) == 64
    words = lambda text: set(re.findall(r"[A-Za-z']+", text))  # noqa: E731
    train_words = set().union(*(words(q) for q, _, _ in train))
    # No training row uses an out-of-form name or item.
    assert not {n for n, _ in OOD_NAMES} & train_words and not set(OOD_ITEMS) & train_words
    for question, solution, answer in ood:
        assert _evaluate_solution(solution) == answer
        assert words(question) & ({n for n, _ in OOD_NAMES} | set(OOD_ITEMS)) or "pages" in question
        assert _computation(question) not in {_computation(q) for q, _, _ in train + test}
        # Nor does any training or test problem compute it (the same steps on the same operands).
        assert solution not in {s for _, s, _ in train + test}
    # Every template has its reworded twin in the set's 64 problems, computing what the twin computes.
    assert {s.count("=") for _, s, _ in ood} == {1, 2}
    rng = random.Random(0)
    shape = lambda solution: re.sub(r"\d+", "N", solution)  # noqa: E731  (the steps without their numbers)
    for template, twin in zip(TEMPLATES, OOD_TEMPLATES, strict=True):
        drawn = [template(rng, "Tom", "he", "apples") for _ in range(300)]
        twins = [twin(rng, "Nina", "she", "coins") for _ in range(300)]
        assert {shape(s) for _, s, _ in drawn} == {shape(s) for _, s, _ in twins}, template.__name__
        assert all(_evaluate_solution(s) == a for _, s, a in twins)
        assert not {_computation(q) for q, _, _ in drawn} & {_computation(q) for q, _, _ in twins}


def test_rows_are_verl_chat_rows_with_a_gsm8k_style_solution():
    row = make_row(("Tom has 3 apples and gets 4 more. How many apples does he have now?", "3 + 4 = 7.", 7),
                   "test", 0)
    assert row["data_source"] == "word_problems"
    assert row["prompt"] == [{"role": "user", "content": "Tom has 3 apples and gets 4 more. How many apples does "
                                                         "he have now? End with \"The answer is N.\""}]
    assert row["reward_model"]["ground_truth"] == "7"
    assert row["extra_info"]["answer"].endswith("#### 7")


def test_fewshot_rows_are_plain_text_with_two_worked_training_problems(tmp_path):
    """A base model's format (--prompt-format fewshot): every split's prompt is the same two training problems, worked
    and answered as the scorer reads them, then the problem and "Answer:"; the held-out sets stay held out."""
    assert verl_main(["data", "word-problems", "--out", str(tmp_path), "--num-train", "30", "--num-test", "8",
                      "--num-test-ood", "4", "--prompt-format", "fewshot"]) == 0
    rows = {split: pq.read_table(tmp_path / f"{split}.parquet").to_pylist() for split in ("train", "test", "test_ood")}
    shots = rows["train"][0]["prompt"].split("\n\n")[:2]
    assert len(shots) == 2
    for shot, train_row in zip(shots, rows["train"][:2], strict=True):
        question, answer = train_row["extra_info"]["question"], train_row["reward_model"]["ground_truth"]
        assert shot.startswith(f"Question: {question}\nAnswer: ") and shot.endswith(f" The answer is {answer}.")
        assert extract_answer(shot) == answer
    for split, found in rows.items():
        for row in found:
            assert isinstance(row["prompt"], str), split
            assert row["prompt"] == "\n\n".join(shots) + f"\n\nQuestion: {row['extra_info']['question']}\nAnswer:"
    held_out = {_computation(r["extra_info"]["question"]) for r in rows["test"]}
    assert not held_out & {_computation(r["extra_info"]["question"]) for r in rows["train"]}
    # A base model's completion ends where it begins a problem of its own: the answer before that is scored
    row = rows["test"][0]
    truth, extra = row["reward_model"]["ground_truth"], row["extra_info"]
    wrong = str(int(truth) + 1)
    rambling = f" 2 + 2 = {truth}. The answer is {truth}.\n\nQuestion: Tom has 1 pen.\nAnswer: The answer is {wrong}."
    assert default_compute_score(row["data_source"], rambling, truth, extra) == 1.0
    assert default_compute_score(row["data_source"], rambling, truth, None) == 0.0  # the last marker, uncut
    assert default_compute_score(row["data_source"], f" The answer is {wrong}.\nQuestion: The answer is {truth}.",
                                 truth, extra) == 0.0
    assert "stop" not in make_row(("q?", "1 + 1 = 2.", 2), "test", 0)["extra_info"]  # chat rows: the whole response
    with pytest.raises(SystemExit):
        verl_main(["data", "word-problems", "--out", str(tmp_path / "x"), "--prompt-format", "few"])


def test_the_quickstart_gives_a_checkpoint_without_a_chat_template_the_fewshot_format(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert quickstart.has_chat_template(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert not quickstart.has_chat_template(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert quickstart.has_chat_template(str(tmp_path))
    assert not quickstart.has_chat_template(str(tmp_path / "missing"))


def test_verl_data_word_problems_writes_both_splits_and_the_out_of_form_set(tmp_path, capsys):
    assert verl_main(["data", "word-problems", "--out", str(tmp_path), "--num-train", "20", "--num-test", "8",
                      "--num-test-ood", "5"]) == 0
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    ood = pq.read_table(tmp_path / "test_ood.parquet").to_pylist()
    assert len(train) == 20 and len(test) == 8 and len(ood) == 5
    assert all(r["extra_info"]["out_of_form"] is True and r["extra_info"]["split"] == "test_ood" for r in ood)
    assert not any(r["extra_info"].get("out_of_form") for r in train + test)
    assert verl_main(["data", "word-problems", "--out", str(tmp_path), "--num-train", "20", "--num-test", "8",
                      "--num-test-ood", "0"]) == 0
    assert not (tmp_path / "test_ood.parquet").exists()  # not left over from the first call
    for row in test:
        assert compute_score(f"The answer is {row['reward_model']['ground_truth']}.",
                             row["reward_model"]["ground_truth"]) == 1.0
    file = tmp_path / "file"
    file.write_text("")
    assert verl_main(["data", "word-problems", "--out", str(file)]) == 2
    assert "expected a directory" in capsys.readouterr().err


@pytest.mark.parametrize("response, truth, expected", [
    ("3 + 4 = 7.\nThe answer is 7.", "7", 1.0),
    ("The answer is 7", 7, 1.0),
    ("the answer is: $1,200.", "1200", 1.0),
    ("#### 12", "12", 1.0),
    ("The answer is 12.0.", "12", 1.0),
    ("The answer is 24.\n24 / 4 = 6 apples each.", "6", 0.0),   # a number after the marker is no answer
    ("The answer is 24.\nNo: 24 / 4 = 6. The answer is 6.", "6", 1.0),  # the final answer counts
    ("x" * 5000 + " The answer is 6.", "6", 1.0),                 # however long the response (was: 600 chars)
    ("3 + 4 = 7. So he has 7 apples.", "7", 0.0),                # no marker: no reward
    ("The answer is N.", "7", 0.0),
    ("The answer is 5.\nThe answer is N.", "5", 1.0),
    ("The answer is -3.", "3", 0.0),
])
def test_the_scorer_reads_the_final_answer_marker(response, truth, expected):
    assert compute_score(response, truth) == expected
    assert default_compute_score("word_problems", response, truth) == expected
    assert load_reward_fn("word_problems")("any_source", response, truth) == expected


def test_extract_answer():
    assert extract_answer("so 5 + 2 = 7. The answer is 7. #### 8") == "8"
    assert extract_answer("#### 1,234") == "1234"
    assert extract_answer("no answer here 42") is None


# ----------------------------------------------------------------------------- the quickstart's real-model path
SMOLLM2_CONFIG = os.path.join(quickstart.REPO, "configs", "grpo_smollm2_gsm.yaml")


def test_a_pretrained_model_directory_means_no_sft_stage(tmp_path):
    assert quickstart.pretrained_model(SMOLLM2_CONFIG, []) == quickstart.SMOLLM2_DIR
    arith = os.path.join(quickstart.REPO, quickstart.DEFAULT_RL_CONFIG)
    assert quickstart.pretrained_model(arith, []) is None  # a config.json: SFT warm-starts it
    assert quickstart.pretrained_model(arith, [f"actor_rollout_ref.model.path={tmp_path}"]) == str(tmp_path)
    assert quickstart.pretrained_model(SMOLLM2_CONFIG, ["actor_rollout_ref.model.path=configs/models/"
                                                        "qwen2_tiny_arith.json"]) is None
    assert quickstart.default_out("configs/grpo_smollm2_gsm.yaml").endswith("quickstart_grpo_smollm2_gsm")


def test_the_smollm2_config_passes_the_quickstart_check_before_its_data_exists(tmp_path):
    from helpers.real_model import smollm2_dir

    model = smollm2_dir()
    assert model == quickstart.SMOLLM2_DIR
    config = quickstart.check_configs(os.path.join(quickstart.REPO, quickstart.DEFAULT_SFT_CONFIG), [],
                                      SMOLLM2_CONFIG, str(tmp_path / "data"), str(tmp_path / "out"),
                                      ["trainer.total_training_steps=4"], model)
    # Its own tokenizer (the chat template) and no SFT architecture anywhere.
    assert config.data.tokenizer == model and config.actor_rollout_ref.model.path == model
    assert config.trainer.total_training_steps == 4 and config.trainer.test_freq == 5
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists()


def test_a_bad_override_on_the_real_model_path_is_one_line_before_any_stage(tmp_path, capsys, monkeypatch):
    from helpers.real_model import smollm2_dir

    smollm2_dir()  # built: the check runs without a model stage

    def run_stage(console, stage, *args, **kwargs):
        raise AssertionError(f"the {stage} stage ran")

    monkeypatch.setattr(quickstart, "run_stage", run_stage)
    out = tmp_path / "qs"
    assert quickstart.main(["--config", "configs/grpo_smollm2_gsm.yaml", "--out", str(out),
                            "actor_rollout_ref.rollout.n=0"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("quickstart: config error: rl config: "), lines
    assert not out.exists()


def test_the_real_model_summary_reports_the_checkpoint_and_peak_rss(tmp_path):
    import json

    records = [{"step": 0, "val/accuracy": 0.125, "val/num_samples": 64.0},
               {"step": 1, "timing_s/step": 30.0, "perf/cpu_memory_used_gb": 5.5, "perf/total_num_tokens": 100.0},
               {"step": 2, "timing_s/step": 32.0, "perf/cpu_memory_used_gb": 6.25, "perf/total_num_tokens": 100.0,
                "val/accuracy": 0.3125, "val/num_samples": 64.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = quickstart.summarize(str(tmp_path), {"data": 1.0, "grpo": 70.0}, 0, 2, pretrained="/m/smollm2")
    assert summary["peak_rss_gb"] == 6.25 and summary["step_s"] == 31.0
    assert summary["val_accuracy_gain_points"] == pytest.approx(18.75)
    text = quickstart.format_summary(summary, str(tmp_path), "GRPO")
    assert re.search(r"val/accuracy before RL \(the checkpoint, greedy, 64 held-out\) +0\.125", text), text
    assert "+18.8 points" in text and "/m/smollm2" in text and "SFT export" not in text
    assert re.search(r"peak RSS of the largest rank .*  6\.25", text)
    # Command A's table is unchanged: no RSS row, the SFT rows as before.
    plain = quickstart.format_summary(quickstart.summarize(str(tmp_path), {"grpo": 70.0}, 0, 2), str(tmp_path),
                                      "GRPO")
    assert "after SFT  (RL step 0" in plain and "SFT export" in plain and "peak RSS" not in plain


def test_cut_at_stop_takes_the_first_stop_of_any_and_leaves_rows_without_one_whole():
    from verl.utils.reward_score import cut_at_stop

    text = "a Question: b ## c"
    assert cut_at_stop(text, {"stop": ["##", "Question:"]}) == "a "
    assert cut_at_stop(text, {"stop": "##"}) == "a Question: b "
    assert cut_at_stop(text, {"stop": ("nowhere",)}) == text
    assert cut_at_stop(text, {"index": 3}) == text and cut_at_stop(text, None) == text


def test_the_gemma3_add_sub_config_loads_and_stops_where_each_worked_answer_ends(tmp_path):
    """configs/grpo_gemma3_add_sub.yaml (results/gemma3_add_sub/) on the data its run writes: it loads as verl train
    loads it, and its stop token is the one that ends every worked answer of the prompt in this tokenizer, so a
    response ends where a shot's answer ends (not in a question of the model's own)."""
    from helpers.gemma3_model import gemma3_dir
    from transformers import AutoTokenizer

    from verl.trainer.config import load_config

    model_dir = gemma3_dir()
    data = tmp_path / "data"
    assert verl_main(["data", "word-problems", "--out", str(data), "--num-train", "40", "--num-test", "8",
                      "--num-test-ood", "4", "--kinds", "loses_some,gets_more", "--num-shots", "1",
                      "--prompt-format", "fewshot"]) == 0
    cfg = load_config(os.path.join(quickstart.REPO, "configs", "grpo_gemma3_add_sub.yaml"),
                      [f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet",
                       f"data.tokenizer={model_dir}", f"actor_rollout_ref.model.path={model_dir}",
                       f"trainer.output_dir={tmp_path}/out"])
    stops = cfg.actor_rollout_ref.rollout.stop_token_ids
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    row = pq.read_table(data / "test.parquet").to_pylist()[0]
    ids = tokenizer(row["prompt"]).input_ids
    assert len(ids) <= cfg.data.max_prompt_length
    shot_end = tokenizer(row["prompt"].split("Question:")[1], add_special_tokens=False).input_ids
    assert shot_end[-1] in stops and tokenizer.decode([shot_end[-1]]) == "\n\n"
    assert cfg.actor_rollout_ref.model.lora.rank > 0  # full fine-tuning collapses on this model (the pilots)
