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
from verl.utils.dataset.word_problems import TEMPLATES, generate_problems, make_row
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


def test_splits_are_seeded_disjoint_and_the_test_split_does_not_depend_on_num_train():
    train, test = generate_problems(300, 40, seed=5)
    assert len(train) == 300 and len(test) == 40
    assert not {q for q, _, _ in train} & {q for q, _, _ in test}
    assert len({q for q, _, _ in train}) == 300
    assert generate_problems(300, 40, seed=5) == (train, test)
    assert generate_problems(900, 40, seed=5)[1] == test
    assert generate_problems(300, 40, seed=6)[1] != test
    with pytest.raises(DatasetError, match="num_test >= 1"):
        generate_problems(10, 0)


def test_rows_are_verl_chat_rows_with_a_gsm8k_style_solution():
    row = make_row(("Tom has 3 apples and gets 4 more. How many apples does he have now?", "3 + 4 = 7.", 7),
                   "test", 0)
    assert row["data_source"] == "word_problems"
    assert row["prompt"] == [{"role": "user", "content": "Tom has 3 apples and gets 4 more. How many apples does "
                                                         "he have now? End with \"The answer is N.\""}]
    assert row["reward_model"]["ground_truth"] == "7"
    assert row["extra_info"]["answer"].endswith("#### 7")


def test_verl_data_word_problems_writes_both_splits(tmp_path, capsys):
    assert verl_main(["data", "word-problems", "--out", str(tmp_path), "--num-train", "20", "--num-test", "8"]) == 0
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(train) == 20 and len(test) == 8
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
    ("The answer is 24.\n24 / 4 = 6 apples each.", "6", 0.0),   # the first answer counts, not a later one
    ("3 + 4 = 7. So he has 7 apples.", "7", 0.0),                # no marker: no reward
    ("The answer is N.", "7", 0.0),
    ("The answer is 5.\nThe answer is N.", "5", 1.0),
    ("The answer is -3.", "3", 0.0),
])
def test_the_scorer_reads_the_first_final_answer_marker(response, truth, expected):
    assert compute_score(response, truth) == expected
    assert default_compute_score("word_problems", response, truth) == expected
    assert load_reward_fn("word_problems")("any_source", response, truth) == expected


def test_extract_answer():
    assert extract_answer("so 5 + 2 = 7. The answer is 7. #### 8") == "7"
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
