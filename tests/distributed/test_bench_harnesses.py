"""The bench harnesses behind published figures, run on a tiny case (issue 57 item 6): each finishes, reports both
sides, and both sides did the same work. The reward pool's bench (README "Rewards off the critical path"): the
in-step and pooled runs sample the same responses and score them alike, step by step. The agent prefix cache's
(docs/agentic.md) and LoRA vs full fine-tuning's (docs/lora.md): below.

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


def test_the_prefix_cache_bench_runs_the_same_trajectories_with_and_without_the_cache(tmp_path):
    """``launch/bench_agent_prefix_cache.py`` (docs/agentic.md's figure) on the tiny chat model with a tool-call
    format that makes every turn a calculator call: the three runs did the same work (the same engine calls, turns
    and turn-prompt tokens), only the cache-on run took any of it from kept K/V, and every trajectory is identical."""
    import helpers.turn_tool_calls  # noqa: F401  (registers the test_turn_calls format)
    import pyarrow as pa
    import pyarrow.parquet as pq
    from helpers.chat_models import save_chat_model

    from launch.bench_agent_prefix_cache import measure

    model = save_chat_model(str(tmp_path / "model"), seed=3)
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": p}], "agent_name": "tool_agent", "extra_info": {"index": i}}
        for i, p in enumerate(["6*7?", "Compute 6*7.", "9-2?"])]), tmp_path / "rows.parquet")
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.calculator.CalculatorTool\n    config: {type: native}\n")
    result = measure(model, str(tmp_path / "rows.parquet"), 3, str(tools), response_length=72,
                     max_assistant_turns=3, tool_format="test_turn_calls", turn_tokens=8)
    off, on, off_again = result["runs"]
    assert result["rows"] == 3 and result["same"] == 3
    assert off["calls"] == on["calls"] == off_again["calls"] and off["turns"] == on["turns"] > 1
    assert off["prompt_tokens"] == on["prompt_tokens"] == off_again["prompt_tokens"] > 0
    assert off["cached_tokens"] == 0 == off_again["cached_tokens"] and on["cached_tokens"] > 0


def test_the_lora_vs_full_bench_runs_both_sides_on_the_same_work(tmp_path):
    """``launch/bench_lora_vs_full.py`` (docs/lora.md's figure) on the tiny arithmetic model, one step each: both
    `verl bench train` runs finish and report their phases, and their first steps sampled and scored the same work
    (LoRA starts as the base model, same seed). LoRA's update moved only adapters: its weight sync differs."""
    import json
    import os

    from launch.bench_lora_vs_full import main

    model = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models", "qwen2_tiny_arith.json")
    out = tmp_path / "bench.json"
    assert main(["--model", model, "--prompts", "2", "--n", "2", "--response-length", "8", "--steps", "1",
                 "--warmup", "0", "--lora-rank", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same_first_step_work"] and result["full"]["first_step_work"]["perf/total_num_tokens"] > 0
    for side in ("full", "lora"):
        assert result[side]["s_per_step"] > 0 and result[side]["phases"]["update_actor"] > 0


def test_the_logprob_memory_bench_measures_each_model_in_its_own_process(tmp_path):
    """``launch/bench_logprob_memory.py`` (issue 58 item 4's figure) on two tiny models of 32 and 320 tokens: each
    record comes from its own rank process, holds both phases' resident memory and peak (the peak at least the
    resident), the same tokens per micro-batch, and its ratios to the first model's (the first's are 1)."""
    import json
    import os

    from launch.bench_logprob_memory import main

    models = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models")
    out = tmp_path / "memory.json"
    assert main(["--model", os.path.join(models, "qwen2_tiny_arith.json"), "--model",
                 os.path.join(models, "qwen2_tiny_bench.json"), "--rows", "2", "--prompt-len", "6",
                 "--response-len", "4", "--fixed-chunk-tokens", "3", "--json", str(out)]) == 0
    first, second, fixed = json.loads(out.read_text())["records"]
    assert (first["chunk_tokens"], second["chunk_tokens"], fixed["chunk_tokens"]) == (None, None, 3)
    assert fixed["vocab_size"] == 320  # the last model again
    assert (first["vocab_size"], second["vocab_size"]) == (32, 320)
    assert first["tokens_per_micro_batch"] == second["tokens_per_micro_batch"] == 2 * (6 + 4)
    assert second["response_logits_gib"] == pytest.approx(10 * first["response_logits_gib"])
    for record in (first, second, fixed):
        for phase in ("log_prob", "update"):
            assert record[f"{phase}_peak_gib"] >= record[f"{phase}_resident_gib"] > 0.1  # a torch process
            assert record[f"{phase}_increment_gib"] == pytest.approx(
                record[f"{phase}_peak_gib"] - record[f"{phase}_resident_gib"])
    assert first["log_prob_peak_ratio"] == first["update_peak_ratio"] == 1.0
    assert first["update_increment_ratio"] in (1.0, None)  # None: no increment to compare with
