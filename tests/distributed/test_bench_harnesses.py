"""The bench harnesses behind published figures, run on a tiny case (issue 57 item 6): each finishes, reports both
sides, and both sides did the same work. The reward pool's bench (README "Rewards off the critical path"): the
in-step and pooled runs sample the same responses and score them alike, step by step.

Elsewhere: `verl bench train --baseline hf|trl` (tests/unit/test_bench_train_peer.py, test_hf_grpo_baseline.py),
the cross-pool bench with both baselines verified (tests/distributed/test_cross_pool.py), the roofline
(tests/unit/test_roofline.py), the copy kernels (tests/kernels/test_bench_copy.py)."""

import pytest

pytest.importorskip("megatron.core")


def test_the_reward_pool_bench_runs_both_sides_on_the_same_work():
    from verl.bench.reward_pool import benchmark

    results = benchmark(workers=2, steps=2, sleep_ms=1.0, batch=4, n=2)
    assert results["same_work"], (results["in_step"]["work"], results["pool_2"]["work"])
    assert [w[0] for w in results["in_step"]["work"]] == [1, 2]
    for side in ("in_step", "pool_2"):
        assert results[side]["step"] > 0 and results[side]["reward"] >= 0
