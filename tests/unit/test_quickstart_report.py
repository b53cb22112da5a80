"""The quickstart's checks before its first stage and its closing report (launch/quickstart.py)."""

import os

import pytest

from launch import quickstart
from launch.quickstart import format_summary


@pytest.fixture
def no_stages(monkeypatch):
    """Fail the test if the quickstart starts a stage (data, SFT or RL)."""

    def run_stage(console, stage, *args, **kwargs):
        raise AssertionError(f"the {stage} stage ran")

    monkeypatch.setattr(quickstart, "run_stage", run_stage)


@pytest.mark.parametrize("args, needle", [
    (["trainer.no_such_key=1"], "rl config: trainer.no_such_key: unknown key"),
    (["actor_rollout_ref.actor.optim.lr=-1"], "rl config: actor_rollout_ref.actor.optim.lr: expected a value >= 0"),
    (["actor_rollout_ref.rollout.n=3"], "rl config: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    (["model_engine=torchtitan"], "model_engine='torchtitan': not supported"),
    (["--sft-override", "optim.lr=abc"], "sft config: optim.lr: expected float, found str 'abc'"),
    (["--config", "configs/no_such_file.yaml"], "rl config: --config: expected a YAML file"),
    (["--sft-override", "model.path=/nonexistent/model"], "sft config: model.path"),
], ids=["unknown key", "bad value", "batch sizes", "refused engine", "sft override", "missing --config",
        "missing sft model"])
def test_a_bad_config_is_one_line_and_exit_2_before_any_stage(tmp_path, capsys, no_stages, args, needle):
    out = tmp_path / "qs"
    assert quickstart.main(["--out", str(out), *args]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("quickstart: config error: "), captured.err
    assert needle in lines[0], lines[0]
    assert not out.exists()  # nothing written, not even the output directory


def test_a_bad_override_with_fresh_clears_nothing(tmp_path, capsys, no_stages):
    out = tmp_path / "qs"
    (out / "data").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    assert quickstart.main(["--out", str(out), "--fresh", "trainer.total_training_steps=0"]) == 2
    assert "trainer.total_training_steps: expected a value >= 1" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["data", "metrics.jsonl"]


def test_the_packaged_quickstart_configs_pass_the_check_before_their_data_exists(tmp_path):
    """The check stands the SFT model's architecture in for the SFT export and skips only the data files."""
    for name, engine in (("grpo_arith_tiny", "megatron"), ("ppo_arith_tiny", "megatron"),
                         ("grpo_arith_tiny_fsdp", "dp")):
        config = quickstart.check_configs(
            os.path.join(quickstart.REPO, quickstart.DEFAULT_SFT_CONFIG), [],
            os.path.join(quickstart.REPO, "configs", f"{name}.yaml"), str(tmp_path / "data"), str(tmp_path / "out"),
            ["trainer.total_training_steps=7"])
        assert config.trainer.total_training_steps == 7 and config.model_engine == engine
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists()


def test_quickstart_summary_says_when_the_rl_stage_stopped_before_its_last_step():
    """verl train exits 0 once it checkpointed after a signal (Ctrl-C on its own, a preemption): the quickstart's
    report then says the run is not finished and how to go on, instead of reading like a finished run."""
    summary = {"val_accuracy_after_sft": 0.5, "val_accuracy_after_rl": None, "val_accuracy_sft_trainer": 0.5,
               "val_num_samples": 256, "rl_steps": 13, "rl_resumed_from_step": 0, "rl_total_steps": 100,
               "tokens_per_s": 1.0, "tokens_per_s_per_rank": 0.5, "step_s": 0.3, "gen_s_per_step": 0.03,
               "update_actor_s_per_step": 0.15, "reshard_s_per_step": 0.002, "reshard_bytes_per_step": 1024.0,
               "val_accuracy_gain_points": None, "wall_s": {"data": 1.0, "sft": 2.0, "grpo": 3.0}}
    text = format_summary(summary, "/out", "GRPO")
    assert "GRPO steps" in text and "13 of 100" in text
    assert text.splitlines()[-1] == ("GRPO stopped at step 13 of 100: the trainer was signalled and checkpointed; "
                                     "rerun the same command to resume")
    done = format_summary({**summary, "rl_steps": 100}, "/out", "GRPO")
    assert "100 of 100" in done and "stopped at step" not in done


def test_the_report_puts_the_out_of_form_set_and_the_best_step_next_to_the_in_distribution_figure(tmp_path):
    import json
    import re

    records = [{"step": 0, "val/accuracy": 0.5, "val/num_samples": 256.0, "val/accuracy_out_of_form": 0.1,
                "val/num_samples_out_of_form": 128.0},
               {"step": 1, "timing_s/step": 1.0},
               {"step": 20, "timing_s/step": 1.0, "val/accuracy": 0.9, "val/accuracy_out_of_form": 0.125},
               {"step": 40, "timing_s/step": 1.0, "val/accuracy": 0.875, "val/accuracy_out_of_form": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = quickstart.summarize(str(tmp_path), {"grpo": 3.0}, 0, 40)
    assert (summary["val_accuracy_after_sft"], summary["val_accuracy_after_rl"]) == (0.5, 0.875)
    assert (summary["val_accuracy_best"], summary["val_accuracy_best_step"]) == (0.9, 20)
    assert (summary["val_accuracy_out_of_form_after_sft"], summary["val_accuracy_out_of_form_after_rl"]) == (0.1, 0.2)
    text = format_summary(summary, str(tmp_path), "GRPO")
    assert re.search(r"val/accuracy best  \(step 20\) +0\.900", text), text
    assert re.search(r"val/accuracy_out_of_form \(128 held-out, unseen form\): step 0 -> 40 +0\.100 -> 0\.200", text)


def test_trainer_seed_seeds_the_data_and_the_sft_stage_too():
    assert quickstart.seed_overrides(["trainer.total_training_steps=3"]) == ([], {"sft": [], "rl": []})
    assert quickstart.seed_overrides(["trainer.seed=7", "trainer.seed=3"]) == (
        ["--seed", "3"], {"sft": ["trainer.seed=3"], "rl": ["data.seed=3"]})
    assert quickstart.seed_overrides(["trainer.seed=abc"]) == ([], {"sft": [], "rl": []})  # check_configs says it
    assert quickstart.seed_overrides(["trainer.seed=[1"]) == ([], {"sft": [], "rl": []})


def test_a_seeded_quickstart_passes_the_seed_to_every_stage(tmp_path, monkeypatch):
    commands = {}

    def run_stage(console, stage, cmd, *args, **kwargs):
        commands[stage] = list(cmd)
        if stage == "sft":  # stop there: the RL stage's data.seed is checked above (seed_overrides)
            raise quickstart.StageFailed(stage, 9, "log")

    monkeypatch.setattr(quickstart, "run_stage", run_stage)
    assert quickstart.main(["--out", str(tmp_path / "qs"), "--fresh", "trainer.seed=4"]) == 9
    data = commands["data"]
    assert data[data.index("--seed") + 1] == "4"
    assert "trainer.seed=4" in commands["sft"]
