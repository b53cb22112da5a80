"""README command (A), shortened: data -> SFT -> GRPO through `python -m launch.quickstart`
(what `launch/quickstart.sh` runs after the set-up), on a tiny task, 2 local ranks.

- the run writes metrics.jsonl (greedy val/accuracy at step 0 and at the end, a finite reward),
  the PNG plot, TensorBoard logs, summary.json, and prints the summary table;
- a second run of the same command is idempotent: it skips data and SFT, resumes the finished RL run
  from its checkpoint without training again, and reports the same numbers.
"""

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 240
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A few SFT steps on 64 problems, 2 GRPO steps of 8 prompts x 4 responses, 16 held-out problems.
QUICK = ["--num-train", "64", "--num-test", "16",
         "--sft-override", "trainer.total_training_steps=4", "--sft-override", "data.train_batch_size=32",
         "--sft-override", "data.micro_batch_size_per_gpu=32",
         "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=2",
         "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
         "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32"]


def run_quickstart(out):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "launch.quickstart", "--out", str(out), *QUICK], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"quickstart exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_quickstart_writes_metrics_plot_and_summary_then_reruns_idempotently(tmp_path):
    from verl.utils.tracking import read_metrics

    out = tmp_path / "quickstart"
    first = run_quickstart(out)
    records = read_metrics(str(out))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert math.isfinite(records[0]["val/accuracy"]) and math.isfinite(records[-1]["val/accuracy"])
    # Both held-out sets validated, apart: 16 in-distribution problems, 16 out of form (never more than --num-test).
    assert (records[0]["val/num_samples"], records[0]["val/num_samples_out_of_form"]) == (16.0, 16.0)
    assert 0.0 <= records[-1]["val/accuracy_out_of_form"] <= 1.0
    for record in records[1:]:
        assert math.isfinite(record["critic/score/mean"]) and math.isfinite(record["critic/rewards/mean"])
        assert record["timing_s/update_weights"] >= 0 and record["perf/reshard_bytes"] > 0
    for png in ("metrics.png", "timeline.png"):  # the curves; the phases of the last steps (verl/utils/timeline.py)
        with open(out / png, "rb") as fh:
            assert fh.read(8) == PNG_MAGIC
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))
    assert (out / "sft" / "hf" / "model.safetensors").is_file() and (out / "actor_hf" / "config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["val_accuracy_after_sft"] == records[0]["val/accuracy"]
    assert summary["reshard_s_per_step"] is not None and summary["tokens_per_s"] > 0
    assert "quickstart summary" in first and "val/accuracy after GRPO" in first
    assert summary["val_accuracy_out_of_form_after_rl"] == records[-1]["val/accuracy_out_of_form"]

    second = run_quickstart(out)
    assert "[data] done earlier" in second and "[sft] done earlier" in second
    assert "resuming from the step-2 checkpoint" in second
    assert read_metrics(str(out)) == records  # nothing trained or logged again
    rerun = json.loads((out / "summary.json").read_text())
    assert rerun["val_accuracy_after_rl"] == summary["val_accuracy_after_rl"] and rerun["rl_resumed_from_step"] == 2
