"""Summarize results/variants/logs: the quickstart's variants (MoE on an EP2 actor, a standalone rollout pool, the
V1 async modes), 3 seeds each.

    python results/variants/summarize.py results/variants/logs              # per run, then the table
    python results/variants/summarize.py results/variants/logs --markdown   # the README table, rebuilt

From each run's ``metrics.jsonl``: greedy ``val/accuracy`` on the 256 held-out problems at step 0 (the SFT warm
start), at the last step and the best validated step, ``val/accuracy_out_of_form`` and the bytes each weight sync
moves (``perf/reshard_bytes`` colocated, ``perf/weight_sync_bytes`` to a pool; mean per
step). Spread: the sample standard deviation over the seeds (n - 1) and the range. Step times are printed per run
but not tabled: these runs shared the 2 cores with other jobs."""

import json
import statistics
import sys
from pathlib import Path

VARIANTS = {"moe": "`configs/grpo_qwen3moe_tiny.yaml` (Qwen3-MoE 8 experts top 2, actor TP1 x EP2, rollout TP 1)",
            "pool": "quickstart + `trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.nnodes=1 "
                    "actor_rollout_ref.rollout.n_gpus_per_node=1` (2 training ranks, 1 rollout rank)"}
VARIANTS["colocate_async"] = "quickstart + `trainer.use_v1=true trainer.v1.trainer_mode=colocate_async`"
VARIANTS["separate_async"] = ("quickstart + `trainer.use_v1=true trainer.v1.trainer_mode=separate_async` on the pool "
                              "layout above")
SYNC_BYTES = {"moe": ("perf/reshard_bytes", "received/rank"), "pool": ("perf/weight_sync_bytes", "sent to the pool"),
              "colocate_async": ("perf/reshard_bytes", "received/rank"),
              "separate_async": ("perf/weight_sync_bytes", "sent to the pool")}


def run_figures(run: Path, variant: str) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    ood = {r["step"]: r["val/accuracy_out_of_form"] for r in rows if "val/accuracy_out_of_form" in r}
    steps = [r for r in rows if "timing_s/step" in r]
    key = SYNC_BYTES[variant][0]
    return {"step0": val[0][1], "last": val[-1][1], "best": max(v for _, v in val), "last_step": val[-1][0],
            "gain": 100.0 * (val[-1][1] - val[0][1]), "ood0": ood[val[0][0]], "ood_last": ood[val[-1][0]],
            "s_per_step": statistics.median(r["timing_s/step"] for r in steps),
            "sync_kib": statistics.mean(r[key] for r in steps if key in r) / 1024.0}


def groups(logs: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for variant in VARIANTS:
        runs = sorted((p for p in logs.glob(f"{variant}_seed*") if p.is_dir()),
                      key=lambda p: int(p.name.rsplit("seed", 1)[1]))
        if runs:  # a variant not run yet (VARIANTS="...") has no row
            out[variant] = {int(p.name.rsplit("seed", 1)[1]): run_figures(p, variant) for p in runs}
    return out


def spread(values: list[float], fmt: str) -> str:
    """mean ± sample sd [min, max]."""
    mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:{fmt}} ± {sd:{fmt.replace('+', '')}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def lines(logs: Path) -> list[str]:
    out = []
    for variant, runs in groups(logs).items():
        for seed, f in runs.items():
            out.append(f"{variant} seed {seed}: val/accuracy {f['step0']:.3f} -> {f['last']:.3f} (step "
                       f"{f['last_step']}, {f['gain']:+.1f} points); out-of-form {f['ood0']:.3f} -> "
                       f"{f['ood_last']:.3f}; {f['s_per_step']:.3f} s/step; sync {f['sync_kib']:.0f} KiB")
    return out


def markdown(logs: Path) -> list[str]:
    out = ["<!-- results/variants:runs -->",
           "| run (3 seeds: mean ± sd [min, max]) | val/accuracy at step 0 (SFT warm start) | at step 100 | gain "
           "(points) | best validated step | out-of-form, step 0 -> 100 | weights a sync |",
           "|---|---|---|---|---|---|---|"]
    for variant, runs in groups(logs).items():
        figures = list(runs.values())
        if len(figures) < 3:
            raise SystemExit(f"{logs}: expected 3 seeds of {variant}, found {len(figures)}")
        col = {key: [f[key] for f in figures] for key in figures[0]}
        out.append(f"| {VARIANTS[variant]}, seeds {', '.join(map(str, runs))} | {spread(col['step0'], '.3f')} | "
                   f"{spread(col['last'], '.3f')} | {spread(col['gain'], '+.1f')} | {spread(col['best'], '.3f')} | "
                   f"{statistics.mean(col['ood0']):.3f} -> {statistics.mean(col['ood_last']):.3f} | "
                   f"{statistics.mean(col['sync_kib']):.0f} KiB {SYNC_BYTES[variant][1]} |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
