"""`verl bench gemm` (verl/bench/cpu_gemm.py; the issue-60 finding in results/cpu_gemm/): both paths compute the same
product (oneDNN's differs from torch's by fp32 summation order only), every record holds both timings and their
ratio, and bad arguments are one line with exit 2."""

import pytest
import torch

from verl.bench.cpu_gemm import main, measure

pytestmark = pytest.mark.unit


def test_both_paths_compute_the_same_product_and_are_timed():
    records = measure(shapes=(("tiny", 4, 64, 16), ("tall", 33, 96, 40)), threads=1, repeats=2)
    assert [r["label"] for r in records] == ["tiny", "tall"]
    for r in records:
        # another summation order over K terms: a few fp32 ulps of the output's scale, K-fold at the very worst
        assert r["max_rel_diff"] <= r["k"] * torch.finfo(torch.float32).eps
        assert r["torch_s"] > 0 and r["onednn_s"] > 0
        assert r["speedup"] == pytest.approx(r["torch_s"] / r["onednn_s"])
        assert r["onednn_gflops"] == pytest.approx(2 * r["m"] * r["k"] * r["n"] / r["onednn_s"] / 1e9)


def test_bad_arguments_are_one_line(capsys):
    assert main(["--threads", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("verl bench gemm: --threads and --repeats: expected >= 1")
