"""trainer.logger backends under verl's names: `file` (verl's JSONL format, appended across restarts)
and `wandb` (imported only when asked, one clear error when missing, offline without credentials)."""

import json
import os
import sys
import types

import pytest

from verl.utils.tracking import (
    SUPPORTED_BACKENDS,
    Tracking,
    check_backends,
    file_logger_path,
    read_metrics,
)

CUT = b'{"step": 3, "data": {"critic/score/mean": 0.'  # what kill -9 during a write leaves


def _lines(path):
    with open(path, "rb") as fh:
        return [json.loads(line) for line in fh.read().splitlines()]


@pytest.fixture
def no_logger_env(monkeypatch):
    for key in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR",
                "WANDB_ENTITY", "TENSORBOARD_DIR"):
        monkeypatch.delenv(key, raising=False)


def test_file_logger_writes_verls_line_format_at_verl_file_logger_path(tmp_path, monkeypatch, no_logger_env):
    path = tmp_path / "logs" / "run.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracker = Tracking(str(tmp_path / "out"), backends=["file"], project_name="p", experiment_name="e")
    tracker.log({"critic/score/mean": 0.5, "actor/pg_loss": float("nan"), "training/global_step": 1}, step=1)
    tracker.log({"critic/score/mean": 0.75}, step=2)
    tracker.close()
    tracker.close()  # a second close does nothing
    assert _lines(path) == [
        {"step": 1, "data": {"critic/score/mean": 0.5, "actor/pg_loss": None, "training/global_step": 1}},
        {"step": 2, "data": {"critic/score/mean": 0.75}},
    ]
    # metrics.jsonl is still written, flat, as `verl plot` and the quickstart read it.
    assert [r["step"] for r in read_metrics(str(tmp_path / "out"))] == [1, 2]
    assert not (tmp_path / "p").exists()


def test_file_logger_default_path_follows_verl(tmp_path, monkeypatch, no_logger_env):
    assert file_logger_path("proj", "exp", {}) == os.path.join(".", "proj", "exp.jsonl")
    assert file_logger_path("proj", "exp", {"VERL_FILE_LOGGER_ROOT": str(tmp_path)}) == str(
        tmp_path / "proj" / "exp.jsonl")
    assert file_logger_path("proj", "exp", {"VERL_FILE_LOGGER_ROOT": str(tmp_path),
                                            "VERL_FILE_LOGGER_PATH": "/x/y.jsonl"}) == "/x/y.jsonl"
    monkeypatch.chdir(tmp_path)
    tracker = Tracking(str(tmp_path / "out"), backends=["file"], project_name="proj", experiment_name="exp")
    tracker.log({"a": 1.0}, step=0)
    tracker.close()
    assert _lines(tmp_path / "proj" / "exp.jsonl") == [{"step": 0, "data": {"a": 1.0}}]


def test_file_logger_appends_after_a_restart_with_a_cut_last_line(tmp_path, monkeypatch, no_logger_env):
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    first = Tracking(str(tmp_path / "out"), backends=["file"])
    first.log({"critic/score/mean": 0.1}, step=1)
    first.log({"critic/score/mean": 0.2}, step=2)
    first.close()
    with open(path, "ab") as fh:  # the killed run was writing step 3
        fh.write(CUT)
    resumed = Tracking(str(tmp_path / "out"), backends=["file"])
    resumed.log({"critic/score/mean": 0.3}, step=3)
    resumed.close()
    assert [(r["step"], r["data"]["critic/score/mean"]) for r in _lines(path)] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    with open(path, "rb") as fh:
        assert fh.read().endswith(b"\n")
    # The reader takes the file logger's lines flat, like metrics.jsonl records.
    assert read_metrics(str(path)) == [{"critic/score/mean": v, "step": s} for s, v in ((1, 0.1), (2, 0.2), (3, 0.3))]


def test_wandb_missing_is_one_clear_error_before_anything_is_written(tmp_path, monkeypatch, no_logger_env):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    message = r"trainer\.logger: wandb requested, expected the wandb package \(pip install wandb\), found none"
    with pytest.raises(ValueError, match=message):
        Tracking(str(tmp_path / "out"), backends=["console", "wandb"])
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=message):
        check_backends(["wandb"])


def test_preflight_reports_a_missing_wandb_as_one_line(monkeypatch):
    from verl.trainer.preflight import PreflightError, preflight

    monkeypatch.setitem(sys.modules, "wandb", None)
    config = types.SimpleNamespace(trainer=types.SimpleNamespace(logger=["console", "wandb"]))
    with pytest.raises(PreflightError, match="wandb requested"):
        preflight(config)


def test_unknown_backend_names_the_supported_ones(tmp_path):
    with pytest.raises(ValueError, match=r"trainer\.logger: expected entries among .*'file'.*found 'mlflow'"):
        Tracking(str(tmp_path), backends=["mlflow"])
    assert set(SUPPORTED_BACKENDS) == {"console", "file", "tensorboard", "wandb", "csv"}


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.init_kwargs, self.logged, self.finished = None, [], 0

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        fake = self

        class Run:
            def log(self, data, step=None):
                fake.logged.append((dict(data), step))

            def finish(self, exit_code=None):
                fake.finished += 1

        return Run()


def test_wandb_offline_without_credentials_logs_with_step_and_finishes(tmp_path, monkeypatch, no_logger_env):
    import torch

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    tracker = Tracking(str(tmp_path), backends=["wandb"], project_name="proj", experiment_name="exp",
                       config={"trainer": {"total_training_steps": 2}})
    assert fake.init_kwargs == {"project": "proj", "name": "exp", "entity": None, "mode": "offline",
                                "config": {"trainer": {"total_training_steps": 2}}, "dir": str(tmp_path)}
    tracker.log({"critic/score/mean": torch.tensor(0.5), "x": 1.0}, step=7)
    assert fake.logged == [({"critic/score/mean": 0.5, "x": 1.0}, 7)]
    tracker.close()
    tracker.close()
    assert fake.finished == 1


@pytest.mark.parametrize("env", [{"WANDB_API_KEY": "k"}, {"WANDB_MODE": "online"}, {"WANDB_MODE": "disabled"}])
def test_wandb_mode_is_left_to_wandb_when_configured(tmp_path, monkeypatch, no_logger_env, env):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    Tracking(str(tmp_path), backends=["wandb"]).close()
    assert "mode" not in fake.init_kwargs


def test_wandb_gets_an_omegaconf_config_as_plain_containers(tmp_path, monkeypatch, no_logger_env):
    from omegaconf import OmegaConf

    from verl.utils.tracking import rank_zero_tracking

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = OmegaConf.create({"trainer": {"output_dir": str(tmp_path), "logger": ["wandb"], "project_name": "p",
                                           "experiment_name": "e", "lr": 1e-6}})
    assert rank_zero_tracking(config, rank=1) is None
    rank_zero_tracking(config, rank=0).close()
    assert isinstance(fake.init_kwargs["config"], dict) and fake.init_kwargs["config"]["trainer"]["lr"] == 1e-6
