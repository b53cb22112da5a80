"""`VERL_DEVICE_MAP=multi verl train` (issue 48 item 8 from the command line): a config naming no parallel layout
gets the chosen one (printed in one [layout] block, beside `--cfg job`'s YAML), a layout the user names wins, and
without the variable nothing is chosen. `--cfg job` stops before any rank starts, so no training runs here."""

import os
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cfg_job(tmp_path, model, extra=(), env_extra=None, file_extra=""):
    config = tmp_path / "run.yaml"
    config.write_text(f"actor_rollout_ref:\n  model:\n    path: {model}\ntrainer:\n  n_gpus_per_node: 2\n{file_extra}")
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_DEVICE_MAP", "VERL_DEVICE_MEMORY_GIB")}
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-m", "verl.cli", "train", "--config", str(config), "--cfg", "job",
                           *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return proc


def test_tiny_model_gets_fsdp_and_the_block_names_why(tmp_path):
    proc = cfg_job(tmp_path, "configs/models/qwen2_tiny_arith.json",
                   env_extra={"VERL_DEVICE_MAP": "multi", "VERL_DEVICE_MEMORY_GIB": "10"})
    assert proc.returncode == 0, proc.stderr
    job = yaml.safe_load(proc.stdout)  # the block went to stderr: stdout is still the YAML alone
    assert job["model_engine"] == "dp" and job["actor_rollout_ref"]["actor"]["strategy"] == "fsdp"
    assert job["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] == 1
    block = [line for line in proc.stderr.splitlines() if line.startswith("[layout] ")]
    assert block[0] == "[layout] no parallel layout named: chose data-parallel FSDP, rollout tp=1"
    assert any("10.00 GiB per device (given)" in line for line in block)


def test_a_named_layout_wins_and_no_variable_chooses_nothing(tmp_path):
    named = cfg_job(tmp_path, "configs/models/qwen2_tiny_arith.json",
                    extra=["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
                    env_extra={"VERL_DEVICE_MAP": "multi", "VERL_DEVICE_MEMORY_GIB": "10"})
    assert named.returncode == 0, named.stderr
    job = yaml.safe_load(named.stdout)
    assert job["actor_rollout_ref"]["actor"]["strategy"] == "megatron"
    assert job["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_parallel_size"] == 2
    assert "the layout you named wins (actor_rollout_ref.actor.megatron.tensor_model_parallel_size)" in named.stderr
    plain = cfg_job(tmp_path, "configs/models/qwen2_tiny_arith.json")
    assert plain.returncode == 0, plain.stderr
    assert "[layout]" not in plain.stderr and yaml.safe_load(plain.stdout)["actor_rollout_ref"]["actor"][
        "strategy"] == "megatron"  # the packaged defaults


def test_a_model_no_layout_fits_and_a_bad_memory_size_are_one_line_exit_2(tmp_path):
    # Qwen2.5-0.5B's shape in fp32 on 2 CPU ranks of 2 GiB: no layout fits (offload needs an accelerator).
    small = cfg_job(tmp_path, "configs/models/qwen2p5_0p5b.json",
                    env_extra={"VERL_DEVICE_MAP": "multi", "VERL_DEVICE_MEMORY_GIB": "2"})
    assert small.returncode == 2 and len(small.stderr.strip().splitlines()) == 1, small.stderr
    assert small.stderr.startswith("verl train: layout: expected ")
    bad = cfg_job(tmp_path, "configs/models/qwen2_tiny_arith.json",
                  env_extra={"VERL_DEVICE_MAP": "multi", "VERL_DEVICE_MEMORY_GIB": "lots"})
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "verl train: VERL_DEVICE_MEMORY_GIB: expected a positive number of GiB, found 'lots'")
