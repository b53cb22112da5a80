"""Summarize results/vllm_rollout/logs: the bench ratios and the GRPO runs' s/step, generation time and
rollout/actor probability gap (steps 2-5: step 1 holds the engines' first-call costs)."""

import json
import statistics
import sys
from pathlib import Path

logs = Path(sys.argv[1])
for name in ("bench_rollout_smollm2", "bench_rollout_tiny"):
    record = json.loads((logs / f"{name}.json").read_text())
    line = [f"{name}: batch {record['batch']} x {record['new_tokens']} new tokens"]
    for engine in ("native", "sglang", "vllm"):
        r = record[engine]
        line.append(f"{engine} {r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r else f"{engine} skipped")
    if "tokens_per_s" in record["vllm"]:
        line.append(f"native/vllm {record['native']['tokens_per_s'] / record['vllm']['tokens_per_s']:.2f}x")
    print("; ".join(line))
for run in ("native_a", "vllm_a", "vllm_b", "native_b"):
    rows = [json.loads(x) for x in (logs / run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 2]
    step_s = [r["timing_s/step"] for r in steps]
    gen_s = [r["timing_s/gen"] for r in steps]
    diff = max(r["training/rollout_probs_diff_max"] for r in rows if "training/rollout_probs_diff_max" in r)
    print(f"{run}: s/step median {statistics.median(step_s):.3f} (min {min(step_s):.3f}, max {max(step_s):.3f}); "
          f"gen median {statistics.median(gen_s):.3f} s; rollout_probs_diff_max over steps {diff:.3g}; "
          f"final score {rows[-1].get('critic/score/mean')}")
