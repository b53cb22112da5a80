"""A rank that fails mid-run ends the job with one line naming it, not a wall of tracebacks.

`verl train` on 2 local ranks whose custom reward function raises at step 1: the launcher exits with exactly
one stderr line ``verl train: rank R: <Error>: ...``, no traceback on the console, and the rank's traceback is
in ``<output_dir>/logs/train.rank<R>.traceback``. An input error (a verl.errors.InputError, here a DatasetError:
input the pre-flight checks cannot see) exits 2; anything else, a plain ValueError included, is an internal
error and exits 1.
"""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith"))


@pytest.mark.parametrize("error, code", [("DatasetError", 2), ("ValueError", 1)])
def test_a_failing_rank_is_one_line_with_its_traceback_in_the_log(tmp_path, data_args, error, code):
    reward = tmp_path / "reward.py"
    reward.write_text(f"from verl.utils.dataset.errors import DatasetError\n\n\n"
                      f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    raise {error}('reward server said no')\n")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "verl.cli", "train", "--config", os.path.join(REPO, "configs", "grpo_arith_tiny.yaml"),
         *data_args, f"trainer.output_dir={out}", "trainer.val_before_train=false", "trainer.total_training_steps=1",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
         f"custom_reward_function.path={reward}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr
    match = re.fullmatch(rf"verl train: rank (\d): {error}: reward server said no \(traceback: (\S+)\)", lines[0])
    assert match, lines[0]
    trace = match.group(2)
    assert trace == str(out / "logs" / f"train.rank{match.group(1)}.traceback")
    assert "compute_score" in open(trace, encoding="utf-8").read()
