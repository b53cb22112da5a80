"""Summarize results/sglang_quickstart/logs: the quickstart (configs/grpo_arith_tiny.yaml) with the native rollout and
with SGLang, 3 seeds each, run for run on the same seeds, one run at a time on an otherwise idle 2-core box.

    python results/sglang_quickstart/summarize.py results/sglang_quickstart/logs              # per run
    python results/sglang_quickstart/summarize.py results/sglang_quickstart/logs --markdown   # the README tables

From each run's ``metrics.jsonl``: greedy ``val/accuracy`` on the 256 held-out problems at step 0 (the SFT warm start:
the same for both rollouts of a seed), at the last step and at the best validated step; the medians over the run's
steps of ``timing_s/step`` and ``timing_s/gen``; the largest ``training/rollout_probs_diff_max`` of any step (the
rollout's log-probs against the actor's on the same tokens). Spread: the sample standard deviation over the seeds and
the range."""

import json
import statistics
import sys
from pathlib import Path

ROLLOUTS = {"native": "native (the embedded engine)", "sglang": "SGLang (`rollout.name=sglang`, sglang 0.5.23 CPU)"}


def run_figures(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    steps = [r for r in rows if "timing_s/step" in r]
    return {"step0": val[0][1], "last": val[-1][1], "best": max(v for _, v in val), "last_step": val[-1][0],
            "gain": 100.0 * (val[-1][1] - val[0][1]),
            "step_s": statistics.median(r["timing_s/step"] for r in steps),
            "gen_s": statistics.median(r["timing_s/gen"] for r in steps),
            "diff_max": max(r.get("training/rollout_probs_diff_max", 0.0) for r in steps)}


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
            f"{f['gain']:+.1f} points, best {f['best']:.3f}); step {f['step_s']:.2f} s, gen {f['gen_s']:.2f} s "
            f"(medians); rollout_probs_diff_max <= {f['diff_max']:.1e}"
            for rollout, runs in groups(logs).items() for seed, f in runs.items()]


def markdown(logs: Path) -> list[str]:
    data = groups(logs)
    learning = ["<!-- results/sglang_quickstart:learning -->",
                "| rollout (3 seeds: mean ± sd [min, max]) | val/accuracy at step 0 (SFT warm start) | at step 100 | "
                "gain (points) | best validated step |",
                "|---|---|---|---|---|"]
    speed = ["<!-- results/sglang_quickstart:speed -->",
             "| rollout (3 seeds: mean ± sd [min, max]) | s/step (median of a run) | gen s/step | largest "
             "rollout_probs_diff_max of a run |",
             "|---|---|---|---|"]
    for rollout, runs in data.items():
        figures = list(runs.values())
        if len(figures) < 3:
            raise SystemExit(f"{logs}: expected 3 seeds of {rollout}, found {len(figures)}")
        col = {key: [f[key] for f in figures] for key in figures[0]}
        name = f"{ROLLOUTS[rollout]}, seeds {', '.join(map(str, runs))}"
        learning.append(f"| {name} | {spread(col['step0'], '.3f')} | {spread(col['last'], '.3f')} | "
                        f"{spread(col['gain'], '+.1f')} | {spread(col['best'], '.3f')} |")
        speed.append(f"| {name} | {spread(col['step_s'], '.2f')} | {spread(col['gen_s'], '.2f')} | "
                     f"{max(col['diff_max']):.1e} |")
    seeds = sorted(set(data["native"]) & set(data["sglang"]))
    diffs = [data["sglang"][s]["gain"] - data["native"][s]["gain"] for s in seeds]
    learning.append(f"| SGLang - native, seed by seed | | | {spread(diffs, '+.1f')} | |")
    return learning + [""] + speed


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
