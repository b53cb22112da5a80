"""Summarize results/vllm_rollout/logs: the bench ratios and the GRPO runs' s/step, generation time and
rollout/actor probability gap (steps 2-5: step 1 holds the engines' first-call costs).

    python results/vllm_rollout/summarize.py results/vllm_rollout/logs              # the summary lines
    python results/vllm_rollout/summarize.py results/vllm_rollout/logs --markdown   # README.md's tables, rebuilt

``--markdown`` prints each table of this directory's README.md after its marker line (``<!-- results/... -->``);
tests/unit/test_results_tables.py checks that the README's tables are these, digit for digit."""

import json
import statistics
import sys
from pathlib import Path

BENCHES = {"bench_rollout_smollm2": "SmolLM2-135M-Instruct (real, 30 layers)",
           "bench_rollout_tiny": "0.7M arithmetic Qwen2 (4 layers, head_dim 32)"}
RUNS = {"native_a": "native (1st)", "vllm_a": "vLLM (2nd)", "vllm_b": "vLLM (3rd)", "native_b": "native (4th)"}


def run_figures(logs: Path, run: str) -> dict:
    rows = [json.loads(x) for x in (logs / run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 2]
    step_s = [r["timing_s/step"] for r in steps]
    return {"median": statistics.median(step_s), "min": min(step_s), "max": max(step_s),
            "gen": statistics.median(r["timing_s/gen"] for r in steps),
            "diff": max(r["training/rollout_probs_diff_max"] for r in rows if "training/rollout_probs_diff_max" in r),
            "score": rows[-1].get("critic/score/mean")}


def lines(logs: Path) -> list[str]:
    out = []
    for name in BENCHES:
        record = json.loads((logs / f"{name}.json").read_text())
        line = [f"{name}: batch {record['batch']} x {record['new_tokens']} new tokens"]
        for engine in ("native", "sglang", "vllm"):
            r = record[engine]
            line.append(f"{engine} {r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r else f"{engine} skipped")
        if "tokens_per_s" in record["vllm"]:
            line.append(f"native/vllm {record['native']['tokens_per_s'] / record['vllm']['tokens_per_s']:.2f}x")
        out.append("; ".join(line))
    for run in RUNS:
        f = run_figures(logs, run)
        out.append(f"{run}: s/step median {f['median']:.3f} (min {f['min']:.3f}, max {f['max']:.3f}); "
                   f"gen median {f['gen']:.3f} s; rollout_probs_diff_max over steps {f['diff']:.3g}; "
                   f"final score {f['score']}")
    return out


def markdown(logs: Path) -> list[str]:
    out = ["<!-- results/vllm_rollout:rollout_tokens_per_s -->",
           "| model | batch x new tokens | native | SGLang | vLLM | native / vLLM |", "|---|---|---|---|---|---|"]
    for name, label in BENCHES.items():
        r = json.loads((logs / f"{name}.json").read_text())
        tps = {e: r[e]["tokens_per_s"] for e in ("native", "sglang", "vllm")}
        out.append(f"| {label}, `--threads {r['threads']}` | {r['batch']} x {r['new_tokens']} (prompts of "
                   f"{r['prompt_len']}) | {tps['native']:.0f} tok/s | {tps['sglang']:.0f} tok/s | {tps['vllm']:.0f} "
                   f"tok/s | {tps['native'] / tps['vllm']:.2f}x |")
    out += ["", "<!-- results/vllm_rollout:grpo -->",
            "| run (order) | s/step, steps 2-5: median (min-max) | gen, median | `training/rollout_probs_diff_max` "
            "(max over steps) |", "|---|---|---|---|"]
    for run, label in RUNS.items():
        f = run_figures(logs, run)
        out.append(f"| {label} | {f['median']:.3f} ({f['min']:.3f}-{f['max']:.3f}) | {f['gen']:.3f} s | "
                   f"{f['diff']:.3g} |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
