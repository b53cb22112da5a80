"""Summarize results/vllm_real_grpo/logs: per run (`verl bench train` records, steps 3-7), s/step, tokens/s, the
phases, the mean response length, peak RSS, and the rollout/actor gap over all 7 steps; then vLLM against native,
the medians of each engine's two runs.

    python results/vllm_real_grpo/summarize.py results/vllm_real_grpo/logs              # the summary lines
    python results/vllm_real_grpo/summarize.py results/vllm_real_grpo/logs --markdown   # README.md's table, rebuilt

``--markdown`` prints the table of this directory's README.md after its marker line (``<!-- results/... -->``);
tests/unit/test_results_tables.py checks that the README's table is this, digit for digit."""

import json
import statistics
import sys
from pathlib import Path

RUNS = {"native_a": "native (1st)", "vllm_a": "vLLM (2nd)", "vllm_b": "vLLM (3rd)", "native_b": "native (4th)"}


def run_figures(logs: Path, run: str) -> dict:
    record = json.loads((logs / f"{run}.json").read_text())
    rows = [json.loads(x) for x in (logs / f"{run}.metrics" / "verl.jsonl").read_text().splitlines()]
    gaps = [r["training/rollout_log_probs_diff_max"] for r in rows if "training/rollout_log_probs_diff_max" in r]
    measured = rows[-record["measured_steps"]:]
    phases = record["phases"]
    return {"s": record["s_per_step"], "lo": record["s_per_step_range"][0], "hi": record["s_per_step_range"][1],
            "gen": phases["gen"], "update": phases["update_actor"], "sync": phases["update_weights"],
            "tok_s": record["tokens_per_s"], "rss": record["peak_rss_gb"], "gap": max(gaps), "steps": len(gaps),
            "length": statistics.mean(r["response_length/mean"] for r in measured)}


def engine_medians(logs: Path) -> dict:
    by_engine: dict = {}
    for run in RUNS:
        by_engine.setdefault(run.split("_")[0], []).append(run_figures(logs, run))
    return {e: {k: statistics.median(f[k] for f in figs) for k in ("s", "gen", "update", "tok_s")}
            for e, figs in by_engine.items()}


def lines(logs: Path) -> list[str]:
    out = []
    for run in RUNS:
        f = run_figures(logs, run)
        out.append(f"{run}: s/step {f['s']:.2f} ({f['lo']:.2f}-{f['hi']:.2f}); gen {f['gen']:.2f} s, update_actor "
                   f"{f['update']:.2f} s, update_weights {f['sync']:.3f} s; {f['tok_s']:.0f} tok/s; peak RSS "
                   f"{f['rss']:.2f} GB; mean response {f['length']:.1f} tokens; rollout_log_probs_diff_max "
                   f"{f['gap']:.2g} over {f['steps']} steps")
    m = engine_medians(logs)
    out.append(f"vllm / native: s/step {m['vllm']['s'] / m['native']['s']:.2f}x, gen "
               f"{m['vllm']['gen'] / m['native']['gen']:.2f}x, "
               f"tokens/s {m['vllm']['tok_s'] / m['native']['tok_s']:.2f}x")
    return out


def markdown(logs: Path) -> list[str]:
    out = ["<!-- results/vllm_real_grpo:runs -->",
           "| run (order) | s/step, median (range) | gen | update_actor | weight sync | mean response (tokens) | "
           "tokens/s | peak RSS, largest rank | `training/rollout_log_probs_diff_max` (7 steps) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for run, label in RUNS.items():
        f = run_figures(logs, run)
        out.append(f"| {label} | {f['s']:.2f} ({f['lo']:.2f}-{f['hi']:.2f}) | {f['gen']:.2f} s | {f['update']:.2f} s "
                   f"| {f['sync']:.3f} s | {f['length']:.1f} | {f['tok_s']:.0f} | {f['rss']:.2f} GB | {f['gap']:.2g} |")
    m = engine_medians(logs)
    out.append(f"| vLLM / native (medians of the two runs each) | {m['vllm']['s'] / m['native']['s']:.2f}x | "
               f"{m['vllm']['gen'] / m['native']['gen']:.2f}x | {m['vllm']['update'] / m['native']['update']:.2f}x "
               f"| | | | | |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
