"""Summarize results/gemma3_word_problems/logs: Gemma 3 270M (the base model) learning word problems with GRPO, one
run per seed.

    python results/gemma3_word_problems/summarize.py results/gemma3_word_problems/logs              # per run
    python results/gemma3_word_problems/summarize.py results/gemma3_word_problems/logs --markdown   # README table

From each run's ``metrics.jsonl``: greedy ``val/accuracy`` on the 64 held-out problems (no computation shared with
training) at step 0 (the checkpoint as published), at the last step and at the best validated step;
``val/accuracy_out_of_form`` (wordings, names and items training never shows) where logged; the median step time,
the run's wall time from its step times and the largest ``perf/cpu_memory_used_gb`` a step logged (the resident
memory of the largest rank, GiB). Spread: the sample standard deviation over the seeds (n - 1) and the range."""

import json
import statistics
import sys
from pathlib import Path


def run_figures(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    ood = {r["step"]: r["val/accuracy_out_of_form"] for r in rows if "val/accuracy_out_of_form" in r}
    steps = [r for r in rows if "timing_s/step" in r]
    if not val or not steps:
        raise SystemExit(f"{run}: expected validation rows and step rows in metrics.jsonl, found "
                         f"{len(val)} and {len(steps)}")
    first, last = val[0][0], val[-1][0]
    return {"step0": val[0][1], "last": val[-1][1], "best": max(v for _, v in val), "last_step": last,
            "gain": 100.0 * (val[-1][1] - val[0][1]),
            "ood_gain": 100.0 * (ood[last] - ood[first]) if first in ood and last in ood else float("nan"),
            "s_per_step": statistics.median(r["timing_s/step"] for r in steps),
            "minutes": sum(r["timing_s/step"] for r in steps) / 60.0,
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
            f"{f['gain']:+.1f} points, best {f['best']:.3f}); out-of-form {f['ood_gain']:+.1f} points; "
            f"{f['s_per_step']:.1f} s/step, {f['minutes']:.1f} min of steps; peak RSS {f['peak_gb']:.2f} GiB"
            for seed, f in runs(logs).items()]


def markdown(logs: Path) -> list[str]:
    found = runs(logs)
    col = {key: [f[key] for f in found.values()] for key in next(iter(found.values()))}
    return ["<!-- results/gemma3_word_problems:runs -->",
            "| seeds | val/accuracy at step 0 | at the last step | gain (points) | best validated | out-of-form gain "
            "(points) | s/step, median | minutes of steps | RSS of the largest rank |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {', '.join(map(str, found))} | {spread(col['step0'], '.3f')} | {spread(col['last'], '.3f')} | "
            f"{spread(col['gain'], '+.1f')} | {spread(col['best'], '.3f')} | {spread(col['ood_gain'], '+.1f')} | "
            f"{statistics.median(col['s_per_step']):.1f} | {spread(col['minutes'], '.1f')} | "
            f"{max(col['peak_gb']):.2f} GiB |"]


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
