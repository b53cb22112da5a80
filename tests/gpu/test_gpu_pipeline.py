"""The CPU tiers' pipeline functions on one GPU: Megatron + native rollout + the CUDA reshard executor.

- two ranks share the GPU over gloo with CUDA tensors (NCCL refuses two ranks on one device): a TP2
  Megatron actor reshards into TP1 and TP2 native rollouts, bit-exact, and greedy equals Megatron's
  greedy before and after an optimizer step (the same job as tests/distributed/test_rollout_after_train_step.py);
- ``verl bench kernels --device cuda`` and ``verl bench reshard`` produce the CPU tier's JSON fields.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.tiny_models import save_tiny_model  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "distributed"))
from train_step_reshard import train_step_job  # noqa: E402

CASES = {"qwen2 tp2 -> rollout tp1": ("qwen2", 2, 1, 1), "qwen2 tp2 -> rollout tp2": ("qwen2", 2, 1, 2)}


def test_two_ranks_on_one_gpu_reshard_in_place_and_greedy_matches_megatron(tmp_path):
    hf = save_tiny_model("qwen2", str(tmp_path / "qwen2"), seed=3)
    cases = {name: (hf, tp, pp, rtp) for name, (_, tp, pp, rtp) in CASES.items()}
    ranks = run_ranks(train_step_job, 2, cases, timeout_s=600)
    for rank, results in enumerate(ranks):
        for case, r in results.items():
            assert r["update_successful"], (rank, case)
            assert r["same_rollout_buffer"], (rank, case)
            assert r["native_before"] == r["megatron_before"], (rank, case)
            assert r["megatron_after"] != r["megatron_before"], (rank, case)
            assert r["native_after"] == r["megatron_after"], (rank, case)


def test_bench_kernels_on_cuda_reports_the_cpu_fields(tmp_path):
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, "-m", "verl.cli", "bench", "kernels", "--sizes-mb", "1,16",
                           "--repeats", "3", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = json.loads(out.read_text())
    assert records and all({"case", "segments"} <= set(r) for r in records)


def test_cuda_is_what_the_device_rule_picks():
    from verl.utils.device import get_device

    assert get_device() == torch.device("cuda", torch.cuda.current_device())
