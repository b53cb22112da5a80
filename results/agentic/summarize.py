"""Summarize results/agentic/logs: SmolLM2-135M-Instruct with the calculator tool (verl's tool_agent loop), GRPO after
a 2-step SFT warm-up, one run per seed.

    python results/agentic/summarize.py results/agentic/logs              # per run
    python results/agentic/summarize.py results/agentic/logs --markdown   # README table

From each run's ``metrics.jsonl``: greedy ``val/accuracy`` on the 64 held-out problems (no expression shared with
training) at step 0 (after the warm-up), at the last step and at the best validated step; the held-out tool-call rate
(``val-aux/tool_call_counts/mean``) at step 0 and at the last step; the median step time and the largest
``perf/cpu_memory_used_gb`` a step logged (GiB). Spread: the sample standard deviation over the seeds (n - 1) and the
range."""

import json
import statistics
import sys
from pathlib import Path


def run_figures(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val/accuracy"], r.get("val-aux/tool_call_counts/mean", 0.0))
           for r in rows if "val/accuracy" in r]
    steps = [r for r in rows if "timing_s/step" in r]
    if not val or not steps:
        raise SystemExit(f"{run}: expected validation rows and step rows in metrics.jsonl, found "
                         f"{len(val)} and {len(steps)}")
    return {"step0": val[0][1], "last": val[-1][1], "best": max(v for _, v, _ in val), "last_step": val[-1][0],
            "gain": 100.0 * (val[-1][1] - val[0][1]), "calls0": val[0][2], "calls_last": val[-1][2],
            "s_per_step": statistics.median(r["timing_s/step"] for r in steps),
            "peak_gb": max(r.get("perf/cpu_memory_used_gb", 0.0) for r in steps)}


def runs(logs: Path) -> dict[int, dict]:
    found = sorted((p for p in logs.glob("seed*") if p.is_dir()), key=lambda p: int(p.name[4:]))
    return {int(p.name[4:]): run_figures(p) for p in found}


def spread(values: list[float], fmt: str) -> str:
    """mean ± sample sd [min, max] (one value: the value)."""
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    mean, sd = statistics.mean(values), statistics.stdev(values)
    return f"{mean:{fmt}} ± {sd:{fmt.replace('+', '')}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def lines(logs: Path) -> list[str]:
    return [f"seed {seed}: val/accuracy {f['step0']:.3f} -> {f['last']:.3f} (step {f['last_step']}, "
            f"{f['gain']:+.1f} points, best {f['best']:.3f}); held-out tool calls a problem {f['calls0']:.2f} -> "
            f"{f['calls_last']:.2f}; {f['s_per_step']:.1f} s/step; peak RSS {f['peak_gb']:.2f} GiB"
            for seed, f in runs(logs).items()]


def markdown(logs: Path) -> list[str]:
    found = runs(logs)
    col = {key: [f[key] for f in found.values()] for key in next(iter(found.values()))}
    return ["<!-- results/agentic:runs -->",
            "| seed | val/accuracy at step 0 (after the 2-step warm-up) | at step 10 | gain (points) | best validated "
            "| held-out tool calls a problem, step 0 -> 10 |",
            "|---|---|---|---|---|---|",
            *(f"| {seed} | {f['step0']:.3f} | {f['last']:.3f} | {f['gain']:+.1f} | {f['best']:.3f} | "
              f"{f['calls0']:.2f} -> {f['calls_last']:.2f} |" for seed, f in found.items()),
            f"| mean ± sd [min, max] | {spread(col['step0'], '.3f')} | {spread(col['last'], '.3f')} | "
            f"{spread(col['gain'], '+.1f')} | {spread(col['best'], '.3f')} | "
            f"{statistics.mean(col['calls0']):.2f} -> {statistics.mean(col['calls_last']):.2f} |"]


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
