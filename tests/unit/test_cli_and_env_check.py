"""The `verl` console script and `verl check-env`."""

import io
import json
import os
import subprocess
import sys

import pytest

import verl
from verl.cli import main as verl_main
from verl.utils import env_check

VERL = [sys.executable, "-m", "verl.cli"]


def test_version_and_help():
    out = subprocess.run(VERL + ["--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"verl-hpc {verl.__version__}"
    out = subprocess.run(VERL + ["--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for command in ("check-env", "bench", "data"):
        assert command in out.stdout


def test_unknown_command_is_one_line_exit_2(capsys):
    assert verl_main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected a command" in err[0] and "'frobnicate'" in err[0]
    assert verl_main(["bench", "nope"]) == 2
    assert "expected one of" in capsys.readouterr().err


def test_check_env_all_required_present():
    buf = io.StringIO()
    assert env_check.check_env(buf) == 0
    text = buf.getvalue()
    for name in ("python", "torch", "megatron-core", "verl._C (cpu)", "mpi4py", "slurm", "sglang", "apex", "nvcc",
                 "gpus"):
        assert any(line.split("]", 1)[1].strip().startswith(name) for line in text.splitlines()), name
    assert all(line[:3] in ("[✓]", "[!]", "[✗]") for line in text.splitlines())


def test_check_env_without_slurm_on_path_prints_the_fix(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # an empty PATH: no Slurm, no nvcc on PATH
    out = subprocess.run([sys.executable, "-m", "verl.cli", "check-env"], capture_output=True, text=True,
                         env=env, timeout=120)
    slurm = [line for line in out.stdout.splitlines() if "] slurm" in line]
    assert slurm and slurm[0].startswith("[✗]"), out.stdout
    assert "fix: apt-get install -y slurm-client" in slurm[0]
    assert out.returncode == 0  # Slurm is optional for the CPU quickstart


def test_check_env_missing_required_component_exits_1(monkeypatch):
    monkeypatch.setattr(env_check, "check_megatron", lambda: env_check.Check(
        env_check.FAIL, "megatron-core", "not importable", fix='pip install "megatron-core>=0.16.1"', required=True))
    monkeypatch.setattr(env_check, "CHECKS", [env_check.check_python, env_check.check_megatron])
    buf = io.StringIO()
    assert env_check.check_env(buf) == 1
    assert '[✗] megatron-core' in buf.getvalue() and 'fix: pip install "megatron-core>=0.16.1"' in buf.getvalue()


def test_bench_kernels_cli_writes_every_field(tmp_path):
    path = tmp_path / "k.json"
    assert verl_main(["bench", "kernels", "--sizes-mb", "1", "--repeats", "1", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert {r["case"].split("/")[0] for r in records} >= {"qkv_regroup", "gate_up_split", "row_parallel_interleave",
                                                          "vocab_padding_shift", "per_head_bucket"}
    for r in records:
        assert set(r) >= {"case", "bytes", "seconds", "memcpy_seconds", "naive_seconds", "ratio_vs_memcpy",
                          "speedup_vs_naive"}
        assert r["ratio_vs_memcpy"] == pytest.approx(r["memcpy_seconds"] / r["seconds"])


def test_bench_kernels_bad_sizes_exit_2(capsys):
    assert verl_main(["bench", "kernels", "--sizes-mb", "big"]) == 2
    assert "--sizes-mb: expected integers" in capsys.readouterr().err


def test_bench_train_summary_takes_medians_after_the_warmup():
    from verl.bench.train import summarize

    records = [{"step": s, "timing_s/step": t, "timing_s/gen": g, "timing_s/generate_sequences": g / 2,
                "timing_s/update_actor": t - g, "perf/total_num_tokens": 100.0}
               for s, t, g in ((1, 9.0, 5.0), (2, 1.0, 0.4), (3, 2.0, 0.5), (4, 1.5, 0.6))]
    summary = summarize(records, warmup=1)
    assert summary["measured_steps"] == 3 and summary["s_per_step"] == 1.5
    assert summary["phases"] == {"gen": 0.5, "generate_sequences": 0.25, "update_actor": 0.9}
    assert summary["unaccounted_s"] == pytest.approx(1.5 - 1.4)  # the nested generate_sequences is not summed
    assert summary["tokens_per_s"] == pytest.approx(100 / 1.5)


def test_bench_train_trl_baseline_without_trl_is_one_line_exit_2(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert verl_main(["bench", "train", "--baseline", "trl", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--baseline trl: expected TRL importable" in err[0] and "found no module 'trl'" in err[0]


def test_bench_train_child_failure_is_one_line_that_names_only_a_log_that_will_exist(tmp_path, capsys):
    """A failed child: its exit code, one line with its last output line, and the log's path only when
    ``--workdir`` keeps it (a temporary workdir is removed on the way out)."""
    from verl.bench.train import _run_watched

    command = [sys.executable, "-m", "json.tool", str(tmp_path / "missing.json")]
    log = tmp_path / "child.log"
    for kept, where in ((True, f"(log: {log})"), (False, "(--workdir DIR keeps the full log)")):
        assert _run_watched(command, str(log), log_kept=kept) == 2  # argparse: no such file
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("verl bench train: json.tool exited 2: "), err
        assert "missing.json" in err[0] and err[0].endswith(where), err


def test_hf_grpo_baseline_masks_after_eos_and_matches_verls_grpo_advantages():
    """The baseline's GRPO math against verl's published formula (core_algos, the trainer's own)."""
    import numpy as np
    import torch

    from verl.bench.hf_grpo import grpo_advantages, response_mask
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    responses = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert response_mask(responses, eos_id=2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]

    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    mask = torch.ones(8, 3)
    expected, _ = compute_grpo_outcome_advantage(scores.unsqueeze(1) * torch.tensor([[0.0, 0.0, 1.0]]), mask,
                                                 np.repeat(np.arange(2), 4))
    torch.testing.assert_close(grpo_advantages(scores, n=4), expected[:, 0])


def test_only_input_errors_are_one_line_exit_2(monkeypatch, tmp_path, capsys):
    """verl.errors.InputError (and its subclasses) is bad input: one line, exit 2. A ValueError from inside
    the program (torch, numpy, our own code) is an internal error: one line naming the exception and a file
    with its traceback, exit 1."""
    import sys
    import types

    from verl import cli
    from verl.trainer.config.loader import ConfigError

    def command(error):
        module = types.ModuleType("verl_test_command")
        module.main = lambda argv: (_ for _ in ()).throw(error)
        monkeypatch.setitem(sys.modules, "verl_test_command", module)
        return cli._run("verl_test_command", [], "verl test")

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert command(ConfigError("trainer.x: expected an integer, found 'a'")) == 2
    assert capsys.readouterr().err == "verl test: trainer.x: expected an integer, found 'a'\n"
    assert command(ValueError("math domain error")) == 1
    err = capsys.readouterr().err
    assert err.startswith("verl test: internal error: ValueError: math domain error (traceback: ")
    assert len(err.splitlines()) == 1
    assert command(FileNotFoundError(2, "No such file or directory", "/internal/cache")) == 1
