"""Summarize results/fsdp/logs: the FSDP backend's quickstart runs (GRPO and PPO + critic), 3 seeds each.

    python results/fsdp/summarize.py results/fsdp/logs              # per run, then mean +- sd per config
    python results/fsdp/summarize.py results/fsdp/logs --markdown   # the README table, rebuilt

From each run's ``metrics.jsonl``: greedy ``val/accuracy`` on the 256 held-out problems at step 0 (the SFT warm
start) and at the last step, ``val/accuracy_out_of_form`` (128 problems in a form training never shows),
``timing_s/step`` (median over the steps), ``timing_s/update_weights`` and ``perf/reshard_bytes`` (the reshard, mean
per step). Spread: the sample standard deviation over the seeds (n - 1) and the range."""

import json
import statistics
import sys
from pathlib import Path

CONFIGS = {"grpo": "`configs/grpo_arith_tiny_fsdp.yaml` (GRPO, FSDP over 2 ranks, rollout TP 1)",
           "ppo": "`configs/ppo_arith_tiny.yaml actor_rollout_ref.actor.strategy=fsdp` (PPO + critic)"}


def run_figures(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    ood = {r["step"]: r["val/accuracy_out_of_form"] for r in rows if "val/accuracy_out_of_form" in r}
    steps = [r for r in rows if "timing_s/step" in r]
    return {"step0": val[0][1], "last": val[-1][1], "best": max(v for _, v in val), "last_step": val[-1][0],
            "gain": 100.0 * (val[-1][1] - val[0][1]),
            "ood0": ood[val[0][0]], "ood_last": ood[val[-1][0]],
            "s_per_step": statistics.median(r["timing_s/step"] for r in steps),
            "reshard_ms": 1000.0 * statistics.mean(r["timing_s/update_weights"] for r in steps),
            "reshard_kib": statistics.mean(r["perf/reshard_bytes"] for r in steps) / 1024.0}


def groups(logs: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for algo in CONFIGS:
        runs = sorted(logs.glob(f"{algo}_seed*"), key=lambda p: int(p.name.rsplit("seed", 1)[1]))
        out[algo] = {int(p.name.rsplit("seed", 1)[1]): run_figures(p) for p in runs}
    return out


def spread(values: list[float], fmt: str) -> str:
    """mean ± sample sd [min, max]."""
    mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:{fmt}} ± {sd:{fmt.replace('+', '')}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def lines(logs: Path) -> list[str]:
    out = []
    for algo, runs in groups(logs).items():
        for seed, f in runs.items():
            out.append(f"{algo} seed {seed}: val/accuracy {f['step0']:.3f} -> {f['last']:.3f} (step {f['last_step']}, "
                       f"{f['gain']:+.1f} points); out-of-form {f['ood0']:.3f} -> {f['ood_last']:.3f}; "
                       f"{f['s_per_step']:.3f} s/step; reshard {f['reshard_ms']:.1f} ms, {f['reshard_kib']:.0f} KiB")
    return out


def markdown(logs: Path) -> list[str]:
    out = ["<!-- results/fsdp:runs -->",
           "| run (3 seeds: mean ± sd [min, max]) | val/accuracy at step 0 (SFT warm start) | at step 100 | gain "
           "(points) | best validated step | out-of-form, step 0 -> 100 | s/step (median) | reshard/step |",
           "|---|---|---|---|---|---|---|---|"]
    for algo, runs in groups(logs).items():
        figures = list(runs.values())

        def col(key, fmt, figures=figures):
            return spread([f[key] for f in figures], fmt)

        ood0, ood_last = (statistics.mean(f[k] for f in figures) for k in ("ood0", "ood_last"))
        out.append(f"| {CONFIGS[algo]}, seeds {', '.join(map(str, runs))} | {col('step0', '.3f')} | "
                   f"{col('last', '.3f')} | {col('gain', '+.1f')} | {col('best', '.3f')} | "
                   f"{ood0:.3f} -> {ood_last:.3f} | "
                   f"{statistics.mean(f['s_per_step'] for f in figures):.2f} | "
                   f"{statistics.mean(f['reshard_ms'] for f in figures):.1f} ms, "
                   f"{statistics.mean(f['reshard_kib'] for f in figures):.0f} KiB received/rank |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
