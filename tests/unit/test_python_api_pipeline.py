"""``DataPipeline`` / ``RLTrainer`` without a trainer (issue 48 item 5): the pipeline's models mapped onto the dataflow
trainer's settings and verl's keys, its errors (one line naming expected vs found), ``verl.metrics.History`` and its
exports, ``verl.data.DataLoader`` drawing the trainer's batches."""

import csv
import json
import math
import subprocess
import sys

import pytest

from verl.errors import InputError


def exact(responses, ground_truth):
    return [float(r == g) for r, g in zip(responses, ground_truth, strict=True)]


def test_names_are_exported_lazily():
    code = ("import sys, verl; light = 'torch' not in sys.modules; "
            "from verl import DataPipeline, RLTrainer; import verl.api, verl.metrics, verl.data; "
            "print(light, DataPipeline is verl.api.DataPipeline, RLTrainer is verl.api.RLTrainer, "
            "verl.data.DataLoader.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "True", "verl.data.loader"]


def test_pipeline_maps_its_models_onto_verl_keys():
    from verl.api import DataPipeline, TrainerConfig

    pipeline = DataPipeline(actors=[{"model": "m", "tokenizer": "t", "learning_rate": 0.5, "strategy": "fsdp"}],
                            reward_models=[exact, lambda responses: [1.0] * len(responses)], critics=["c"],
                            rollout_config={"n": 3, "temperature": 0.7, "max_response_length": 9},
                            train_config={"batch_size": 6, "overrides": {"trainer.seed": 5}})
    cfg = pipeline.trainer_config
    assert isinstance(cfg, TrainerConfig)
    assert (cfg.model, cfg.tokenizer, cfg.learning_rate, cfg.rollout_n, cfg.max_response_length, cfg.batch_size) == \
        ("m", "t", 0.5, 3, 9, 6)
    assert (cfg.algorithm, cfg.critic) == ("gae", "c")  # a critic: PPO with GAE
    tree = cfg.verl_config(world_size=2)
    assert tree["model_engine"] == "dp" and tree["critic"]["model"]["path"] == "c"
    assert tree["actor_rollout_ref"]["rollout"]["temperature"] == 0.7 and tree["trainer"]["seed"] == 5
    # The reward functions are dataflow nodes, summed into the reward; the rollout hands them what they name.
    flow = pipeline.dataflow
    assert [n.name for n in flow.nodes] == ["rollout", "reward_0", "reward_1", "reward"]
    assert flow.nodes[0].output_keys == ("ground_truth", "responses")
    values = flow.run({"responses": ["3", "4"], "ground_truth": ["3", "5"]}, batch_size=2)
    assert values["reward"].tolist() == [2.0, 1.0]

    model_rm = DataPipeline(actors=["m"], reward_models=["rm_dir"], train_config={"tokenizer": "t"})
    assert model_rm.dataflow is None and model_rm.trainer_config.reward_model == "rm_dir"
    assert model_rm.trainer_config.verl_config(1)["reward_model"]["model"]["path"] == "rm_dir"
    assert model_rm.trainer_config.algorithm == "grpo"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"actors": ["a", "b"]}, r"^actors: expected a list of one actor .* found 2$"),
    ({"actors": "a"}, r"^actors: expected a list of one actor .* found one \(not in a list\)$"),
    ({"actors": [{"model": "m", "lr": 1}]}, r"^actors\[0\]: key 'lr': expected one of"),
    ({"actors": ["m"], "reward_models": [lambda text: text]},
     r"^reward_models\[0\] '<lambda>': parameter 'text': expected parameters named after the rollout's keys"),
    ({"actors": ["m"], "reward_models": [exact, "rm"]}, r"^reward_models: expected reward functions or one reward "),
    ({"actors": ["m"], "critics": ["c"], "train_config": {"algorithm": "grpo"}},
     r"^critics: expected train_config algorithm 'gae' with a critic, found 'grpo'$"),
    ({"actors": ["m"], "train_config": {"epochs": 1}}, r"^train_config: key 'epochs': expected one of"),
])
def test_pipeline_refuses_bad_input_in_one_line(kwargs, message):
    from verl.api import DataPipeline

    with pytest.raises(InputError, match=message):
        DataPipeline(**kwargs)


def test_rl_trainer_needs_data():
    from verl.api import DataPipeline, RLTrainer

    trainer = RLTrainer(pipeline=DataPipeline(actors=["m"], train_config={"tokenizer": "t"}))
    with pytest.raises(InputError, match=r"^RLTrainer.run: expected a dataset .* found neither$"):
        trainer.run()
    with pytest.raises(InputError, match=r"^RLTrainer\(pipeline\): expected a DataPipeline, found dict$"):
        RLTrainer(pipeline={})


def test_history_gives_python_values_and_exports_csv_and_json(tmp_path):
    import verl.metrics

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [
            {"step": 0, "val/acc": 0.1},
            {"step": 2, "actor/pg_loss": -0.5, "critic/score/mean": float("nan"), "tags": [1, 2]},
            {"step": 1, "actor/pg_loss": 0.25, "critic/score/mean": 0.5}]))
    history = verl.metrics.load(str(tmp_path))
    assert [r["step"] for r in history] == [1, 2]  # step 0 (validation before training) left out
    assert history.last()["actor/pg_loss"] == -0.5 and [r["step"] for r in history.last(1)] == [2]
    assert history["actor/pg_loss"] == [0.25, -0.5]
    assert history.names == ["step", "actor/pg_loss", "critic/score/mean", "tags"]
    with pytest.raises(InputError, match=r"^metrics: expected a logged metric name, found 'loss'"):
        history["loss"]
    assert history.to_json(str(tmp_path / "out" / "m.json")) == str(tmp_path / "out" / "m.json")
    exported = json.loads((tmp_path / "out" / "m.json").read_text())
    assert exported[1]["critic/score/mean"] is None and exported[0]["actor/pg_loss"] == 0.25
    history.to_csv(str(tmp_path / "m.csv"))
    with open(tmp_path / "m.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == history.names
    assert rows[0]["tags"] == "" and json.loads(rows[1]["tags"]) == [1, 2]
    assert float(rows[0]["actor/pg_loss"]) == 0.25 and math.isnan(float(rows[1]["critic/score/mean"]))
    with pytest.raises(InputError, match=r"^metrics: expected .*metrics.jsonl, found no such file$"):
        verl.metrics.load(str(tmp_path / "none"))


def test_data_loader_draws_the_trainers_batches(tmp_path):
    from helpers.tiny_models import write_arithmetic_data
    from transformers import AutoTokenizer

    from verl.data import DataLoader, RLHFDataset
    from verl.utils.dataset.rl_dataset import create_rl_sampler

    write_arithmetic_data(tmp_path, num_train=6, num_test=2)
    dataset = RLHFDataset(data_files=str(tmp_path / "train.parquet"),
                          tokenizer=AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer")),
                          config={"max_prompt_length": 8})
    batches = list(DataLoader(dataset, batch_size=2, seed=7))
    order = list(create_rl_sampler({"shuffle": True, "seed": 7}, dataset))
    assert len(batches) == 3 and batches[0]["input_ids"].shape[0] == 2
    want = [dataset[i]["input_ids"].tolist() for i in order]
    assert [row.tolist() for b in batches for row in b["input_ids"]] == want
    with pytest.raises(InputError, match=r"^DataLoader: expected at least batch_size=8 rows, found 6$"):
        DataLoader(dataset, batch_size=8)
