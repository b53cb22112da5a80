"""The Python API's pipeline script (``DataPipeline`` / ``RLTrainer`` / ``verl.metrics``, issue 48 item 5) and what
its run must show, shared by the launcher tests: plain python, torchrun and mpirun
(tests/distributed/test_python_api_library.py), srun (tests/slurm/test_slurm_tier.py). The script is the same file
under every launcher: it names no rank or launcher."""

import csv
import glob
import json
import os
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")
STEPS_OVERRIDE = "trainer.total_training_steps=2"

PIPELINE = """
    import csv, json, sys
    from transformers import AutoTokenizer
    from verl import DataPipeline, RLTrainer
    from verl.api import is_driver
    from verl.data import DataLoader
    from verl.data.rlhf_dataset import RLHFDataset
    import verl.metrics

    calls = []

    def length_reward(responses):
        calls.append([(len(r) % 4) / 4.0 for r in responses])
        return calls[-1]

    def bonus(ground_truth):
        return [0.5] * len(ground_truth)

    def main():
        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
        dataset = RLHFDataset(data_files=DATA, tokenizer=tokenizer, config={"max_prompt_length": 8})
        pipeline = DataPipeline(
            actors=[{"model": MODEL, "tokenizer": TOKENIZER, "learning_rate": 1e-3}],
            reward_models=[length_reward, bonus], critics=[],
            rollout_config={"n": 2, "temperature": 1.0, "max_prompt_length": 8, "max_response_length": 6},
            train_config={"num_epochs": 1, "output_dir": "run"},
            dataset=DataLoader(dataset, batch_size=2, seed=3))
        history = RLTrainer(pipeline=pipeline, overrides=sys.argv[1:]).run()
        assert history is verl.metrics.latest()
        history.to_csv("metrics.csv")
        history.to_json("metrics.json")
        if is_driver():
            print("RESULT " + json.dumps({"last": history.last(), "last2": list(history.last(2)),
                                          "score": history["critic/score/mean"], "calls": calls}))

    if __name__ == "__main__":
        main()
"""


def write_pipeline(run_dir, data) -> str:
    """pipeline.py in ``run_dir`` over the arithmetic data in ``data`` (train.parquet, tokenizer/); its path."""
    script = (f"MODEL = {MODEL!r}\nTOKENIZER = {f'{data}/tokenizer'!r}\nDATA = {f'{data}/train.parquet'!r}\n"
              + textwrap.dedent(PIPELINE))
    path = os.path.join(str(run_dir), "pipeline.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(script)
    return path


def check_pipeline_run(out: str, run_dir) -> None:
    """What every launcher's run of pipeline.py (with STEPS_OVERRIDE, in ``run_dir``) must show in ``out`` (the
    ranks' stdout together) and its exports."""
    results = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, out[-2000:]  # rank 0 drives the output
    result = results[0]
    # No layout named: one block says what was chosen and why (tiny model, host memory per rank: FSDP, rollout tp 1).
    assert out.count("[layout] no parallel layout named: chose data-parallel FSDP, rollout tp=1") == 1, out[-3000:]
    assert result["last"]["step"] == 2 and [r["step"] for r in result["last2"]] == [1, 2]
    # Both reward functions, summed, on batches of the loader's size (2 prompts x n=2) once a step.
    assert [len(c) for c in result["calls"]] == [4, 4]
    for step, call in enumerate(result["calls"]):
        assert result["score"][step] == pytest.approx(sum(call) / 4 + 0.5, abs=1e-6)
    with open(os.path.join(str(run_dir), "metrics.json"), encoding="utf-8") as fh:
        assert json.load(fh) == result["last2"]
    with open(os.path.join(str(run_dir), "metrics.csv"), newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert float(rows[1]["actor/pg_loss"]) == pytest.approx(result["last"]["actor/pg_loss"])
    assert not glob.glob(os.path.join(str(run_dir), "metrics.*.tmp*"))
