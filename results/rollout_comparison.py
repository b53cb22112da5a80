"""What the rollout-engine figures share (results/vllm_quickstart, results/sglang_quickstart): a quickstart run once
per rollout engine and seed, each engine's runs in ``logs/<engine>_seed<N>/metrics.jsonl``, compared with the native
engine's seed by seed. Spread: the sample standard deviation over the seeds and the range."""

import json
import statistics
from pathlib import Path


def run_figures(run: Path) -> dict:
    """Greedy ``val/accuracy`` at step 0 (the SFT warm start), at the last validated step and at the best; the
    medians over the run's steps of ``timing_s/step`` and ``timing_s/gen``; the largest
    ``training/rollout_probs_diff_max`` of any step."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    steps = [r for r in rows if "timing_s/step" in r]
    return {"step0": val[0][1], "last": val[-1][1], "best": max(v for _, v in val), "last_step": val[-1][0],
            "gain": 100.0 * (val[-1][1] - val[0][1]),
            "step_s": statistics.median(r["timing_s/step"] for r in steps),
            "gen_s": statistics.median(r["timing_s/gen"] for r in steps),
            "diff_max": max(r.get("training/rollout_probs_diff_max", 0.0) for r in steps)}


def groups(logs: Path, rollouts: dict[str, str]) -> dict[str, dict[int, dict]]:
    """``{engine: {seed: run_figures}}`` for each engine of ``rollouts``, seeds in order."""
    out: dict[str, dict[int, dict]] = {}
    for rollout in rollouts:
        runs = sorted((p for p in logs.glob(f"{rollout}_seed*") if p.is_dir()),
                      key=lambda p: int(p.name.rsplit("seed", 1)[1]))
        out[rollout] = {int(p.name.rsplit("seed", 1)[1]): run_figures(p) for p in runs}
    return out


def spread(values: list[float], fmt: str) -> str:
    mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:{fmt}} ± {sd:{fmt.replace('+', '')}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def columns(logs: Path, data: dict[str, dict[int, dict]], rollout: str) -> dict[str, list[float]]:
    """Each figure of ``rollout``'s runs as a column; at least 3 seeds."""
    figures = list(data[rollout].values())
    if len(figures) < 3:
        raise SystemExit(f"{logs}: expected 3 seeds of {rollout}, found {len(figures)}")
    return {key: [f[key] for f in figures] for key in figures[0]}


def learning_table(logs: Path, data: dict[str, dict[int, dict]], rollouts: dict[str, str], marker: str,
                   other: str, label: str) -> list[str]:
    """The held-out accuracy table: one row per engine, then ``other``'s gain minus native's, seed by seed."""
    out = [marker,
           "| rollout (3 seeds: mean ± sd [min, max]) | val/accuracy at step 0 (SFT warm start) | at step 100 | gain "
           "(points) | best validated step |",
           "|---|---|---|---|---|"]
    for rollout, runs in data.items():
        col = columns(logs, data, rollout)
        out.append(f"| {rollouts[rollout]}, seeds {', '.join(map(str, runs))} | {spread(col['step0'], '.3f')} | "
                   f"{spread(col['last'], '.3f')} | {spread(col['gain'], '+.1f')} | {spread(col['best'], '.3f')} |")
    seeds = sorted(set(data["native"]) & set(data[other]))
    diffs = [data[other][s]["gain"] - data["native"][s]["gain"] for s in seeds]
    out.append(f"| {label} - native, seed by seed | | | {spread(diffs, '+.1f')} | |")
    return out
