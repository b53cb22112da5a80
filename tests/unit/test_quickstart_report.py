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
