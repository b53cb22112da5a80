"""verl's offline evaluation job: ``python -m verl.trainer.main_eval data.path=... data.response_key=responses ...``
scores each row's responses with its data source's reward function and prints verl's ``test_score/<source>``
(the mean over rows of each row's mean response score)."""

import ast
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.trainer import main_eval

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = [
    # arithmetic: exact match of the number; row scores 1/2 and 1/1 -> source mean 3/4
    {"data_source": "arithmetic", "reward_model": {"ground_truth": "42"}, "responses": ["42", "41"]},
    {"data_source": "arithmetic", "reward_model": {"ground_truth": "7"}, "responses": ["7"]},
    # gsm8k: "#### <answer>"; row scores 2/3 -> source mean 2/3
    {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "18"},
     "responses": ["so #### 18", "#### 18", "#### 17"]},
]


def _parquet(path, rows=ROWS):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _args(path, *extra):
    return [f"data.path={path}", "data.response_key=responses", "data.data_source_key=data_source",
            "data.reward_model_key=reward_model", *extra]


def _metrics(out: str) -> dict:
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_per_source_mean_of_row_means(tmp_path, capsys):
    assert main_eval.main(_args(_parquet(tmp_path / "r.parquet"), "ray_kwargs.ray_init.num_cpus=2")) == 0
    metrics = _metrics(capsys.readouterr().out)
    assert metrics == pytest.approx({"test_score/arithmetic": 0.75, "test_score/openai/gsm8k": 2 / 3})


def test_custom_reward_function(tmp_path, capsys):
    fn = tmp_path / "reward.py"
    fn.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return {'score': float(len(solution_str)), 'acc': True}\n")
    path = _parquet(tmp_path / "r.parquet")
    assert main_eval.main(_args(path, f"custom_reward_function.path={fn}", "custom_reward_function.name=my_score")) == 0
    # lengths: (2+2)/2, 1 -> 1.5; (10+7+7)/3 -> 8
    assert _metrics(capsys.readouterr().out) == pytest.approx({"test_score/arithmetic": 1.5,
                                                                "test_score/openai/gsm8k": 8.0})


@pytest.mark.parametrize("case", ["no_response_column", "unknown_source", "no_ground_truth", "missing_file",
                                  "no_function"])
def test_bad_input_is_one_line_exit_2(case, tmp_path, capsys):
    rows, extra = ROWS, []
    if case == "no_response_column":
        extra = ["data.response_key=answers"]
    elif case == "unknown_source":
        rows = [{**ROWS[0], "data_source": "my/task"}]
    elif case == "no_ground_truth":
        rows = [{**ROWS[0], "reward_model": {"style": "rule"}}]
    elif case == "no_function":
        (tmp_path / "reward.py").write_text("x = 1\n")
        extra = [f"custom_reward_function.path={tmp_path / 'reward.py'}"]
    path = _parquet(tmp_path / "r.parquet", rows) if case != "missing_file" else str(tmp_path / "none.parquet")
    assert main_eval.main(_args(path, *extra)) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("main_eval: error:"), err
    assert captured.out == ""


def test_python_m_main_eval(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_eval", *_args(_parquet(tmp_path / "r.parquet"))],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _metrics(proc.stdout) == pytest.approx({"test_score/arithmetic": 0.75, "test_score/openai/gsm8k": 2 / 3})
