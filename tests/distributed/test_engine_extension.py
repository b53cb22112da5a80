"""A third training engine and a third rollout engine are each one module and one registration (issue 54 item 7):
``tests/helpers/toy_engines.py`` registers both, named by ``actor_rollout_ref.model.external_lib`` (verl's key),
and a GRPO step runs on them through `verl train` on 2 local ranks with no file under ``verl/`` knowing them.
Without the module, the same command line is one config line, exit 2."""

import os
import pathlib
import subprocess

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.train_runs import REPO, read_metrics, run_train, train_cmd, train_env  # noqa: E402

MODULE = "tests.helpers.toy_engines"
ARR = "actor_rollout_ref"
ENGINES = [f"{ARR}.actor.strategy=toy_fsdp", f"{ARR}.ref.strategy=toy_fsdp", f"{ARR}.rollout.name=toy_native"]
ONE_STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.export_hf_at_end=false"]


def test_the_toy_engines_are_one_module_each_and_train_a_step(tmp_path):
    source = pathlib.Path(REPO, *MODULE.split(".")).with_suffix(".py").read_text()
    # What the extension is: its classes and one registration per engine, in one file outside verl/.
    assert source.count("register_engine(EngineEntry(") == 1 and source.count("register_rollout(RolloutEngine(") == 1
    marks = tmp_path / "marks"
    marks.mkdir()
    data = arithmetic_data_args(tmp_path / "arith")
    run_train(train_cmd("grpo_arith_tiny_fsdp.yaml", tmp_path / "out", data, f"{ARR}.model.external_lib={MODULE}",
                        *ENGINES, *ONE_STEP), env={"VERL_TOY_ENGINE_MARKS": str(marks)})
    built = sorted(line for p in marks.iterdir() for line in p.read_text().split())
    # Each rank built the toy actor and reference (FSDP2 under another name) and the toy rollout engine.
    ranks = len({p.name.split(".")[1] for p in marks.iterdir()})
    assert ranks == 2 and built == ["rollout"] * ranks + ["training"] * 2 * ranks, built
    step = read_metrics(tmp_path / "out")[1]
    assert step["actor/grad_norm"] > 0 and "timing_s/gen" in step


def test_without_the_module_the_engine_names_are_one_line(tmp_path):
    data = arithmetic_data_args(tmp_path / "arith")
    proc = subprocess.run(train_cmd("grpo_arith_tiny_fsdp.yaml", tmp_path / "out", data, *ENGINES, "--cfg", "job"),
                          cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{ARR}.actor.strategy: expected one of ['megatron', 'fsdp', 'fsdp2'], found 'toy_fsdp'" in lines[0]
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")
