"""`verl train` with the reward pool (issue 47, item 3: ``reward.num_workers``): the custom reward function runs in
the pool's spawned processes while the step's other passes run, and every sequence's score in the batch is the
function's own (what the in-step path computes); a function that raises on one sample fails the run with one line
naming the sample's row and data source (on the data plane: the row's position in the step's batch)."""

import re
import subprocess

import pytest
from helpers.tiny_models import arithmetic_data_args
from helpers.train_runs import REPO, RUN_TIMEOUT_S, read_metrics, run_train, train_cmd, train_env

pytest.importorskip("megatron.core")

REWARD = '''import multiprocessing
import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Which process scored: the pool's workers are spawned processes, the ranks are each a MainProcess.
    open(os.path.join(os.environ["REWARD_MARKS"], multiprocessing.current_process().name), "a").close()
    if os.environ.get("REWARD_RAISE_ODD") and extra_info["index"] % 2:
        raise ValueError(f"cannot score {solution_str!r}")
    return {"score": 0.25 * len(solution_str) + float(solution_str == ground_truth), "chars": len(solution_str)}
'''
SMALL_STEP = ("data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
              "actor_rollout_ref.actor.ppo_mini_batch_size=8",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "trainer.total_training_steps=1",
              "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false")


def expected_score(output, ground_truth):
    return 0.25 * len(output) + float(output == ground_truth)


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith"))


def test_pool_scores_are_the_reward_functions_and_a_raising_sample_fails_the_step(tmp_path, arithmetic_data):
    import json

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "run"
    run_train(train_cmd("grpo_arith_tiny.yaml", out, arithmetic_data, f"custom_reward_function.path={reward}",
                        "reward.num_workers=2", f"trainer.rollout_data_dir={tmp_path / 'gens'}", *SMALL_STEP),
              env={"REWARD_MARKS": str(marks)})
    assert any(p.name.startswith("SpawnProcess") for p in marks.iterdir()), sorted(p.name for p in marks.iterdir())
    records = [json.loads(line) for line in (tmp_path / "gens" / "1.jsonl").read_text().splitlines()]
    assert len(records) == 16
    # The dump's scores are the batch's token_level_scores, which the pool computed.
    expected = [expected_score(r["output"], r["gts"]) for r in records]
    assert [r["score"] for r in records] == pytest.approx(expected, abs=1e-6)
    assert read_metrics(out)[1]["critic/score/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)

    # The same run on the data plane (each rank sends the pool the rows it holds), the function raising on every
    # prompt of an odd dataset index.
    failed = subprocess.run(
        train_cmd("grpo_arith_tiny.yaml", tmp_path / "failed", arithmetic_data, f"custom_reward_function.path={reward}",
                  "reward.num_workers=2", "transfer_queue.enable=true", *SMALL_STEP),
        cwd=REPO, env={**train_env(), "REWARD_MARKS": str(marks), "REWARD_RAISE_ODD": "1"}, capture_output=True,
        text=True, timeout=RUN_TIMEOUT_S)
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    assert len(lines) == 1, failed.stderr
    assert re.fullmatch(r"verl train: rank \d: RewardScoreError: reward function raised ValueError: cannot score "
                        r"'.*' \(on row \d+ \(data_source='arithmetic', extra_info\.index=\d*[13579]\) of the "
                        r"step's batch\) \(traceback: \S+\)", lines[0]), lines[0]
