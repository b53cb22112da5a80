"""`verl bench train --roofline`: each phase's lower bound from the model's weight matmuls and this machine's measured
limits (verl/bench/roofline.py), checked by hand on a synthetic step."""

import json

import pytest

from verl.bench.roofline import machine_limits, model_matmul_params, phase_bounds, table


def test_the_bounds_are_the_weights_flops_and_reads(tmp_path):
    params = {"body": 1_000_000, "head": 50_000}
    limits = {"threads": 2, "matmul_gflops": 10.0, "copy_gb_s": 5.0}
    # 8 responses of mean 4 (max 6) tokens, 100 tokens in all: 68 prompt tokens
    step = {"timing_s/step": 1.0, "perf/total_num_tokens": 100, "response_length/mean": 4.0,
            "response_length/max": 6, "timing_s/update_actor": 0.5, "timing_s/gen": 0.2, "timing_s/ref": 0.1}
    out = phase_bounds([{"timing_s/step": 9.0}, step], 1, params, limits, rows=8, n=4, replicas=2)
    forward = 2 * 1_000_000 * 100 + 2 * 50_000 * 32  # the head on the 32 response tokens only
    assert out["update_actor"]["bound_s"] == pytest.approx(3 * forward / 10e9)
    assert out["ref"]["bound_s"] == pytest.approx(forward / 10e9)
    # the 2 distinct prompts' prefill (68 tokens over 8 rows = 4 samples of 2 prompts; the head on each prompt's
    # last position) + a read of the weights per decode step per replica
    gen = (2 * 1_000_000 * 68 / 4 + 2 * 50_000 * 2) / 10e9 + 6 * 2 * 1_050_000 * 4 / 5e9
    assert out["gen"]["bound_s"] == pytest.approx(gen)
    assert out["gen"]["fraction"] == pytest.approx(gen / 0.2)
    assert "old_log_prob" not in out  # not timed this step: not reported
    recomputed = phase_bounds([step], 0, params, limits, rows=8, n=4, replicas=2, recompute=True)
    assert recomputed["update_actor"]["bound_s"] == pytest.approx(4 * forward / 10e9)
    rows = table({"machine": limits, "phases": out}).splitlines()[2:]
    fractions = [float(row.split()[-1].rstrip("%")) for row in rows]
    assert [row.split()[0] for row in rows] and fractions == sorted(fractions)  # the largest gap first
    assert {row.split()[0] for row in rows} == set(out)


def test_matmul_params_count_the_head_once_tied_or_not(tmp_path):
    base = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}
    for tied in (True, False):
        path = tmp_path / f"tied_{tied}.json"
        path.write_text(json.dumps({**base, "tie_word_embeddings": tied}))
        p = model_matmul_params(str(path))
        assert p["head"] == 64 * 16
        # one layer: q, k, v (+ biases), o, gate, up, down and two norms, plus the final norm
        layer = 16 * 16 + 16 + 2 * (8 * 16 + 8) + 16 * 16 + 3 * 16 * 32 + 2 * 16
        assert p["body"] == layer + 16


def test_the_machine_limits_are_measured():
    limits = machine_limits(threads=1)
    assert limits["threads"] == 1 and limits["matmul_gflops"] > 0.1 and limits["copy_gb_s"] > 0.1
    libraries = [v for k, v in limits.items() if k.startswith("matmul_gflops_")]
    assert "matmul_gflops_blas" in limits and limits["matmul_gflops"] == max(libraries)
