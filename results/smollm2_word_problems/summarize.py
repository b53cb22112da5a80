"""Summarize results/smollm2_word_problems/logs: SmolLM2-135M-Instruct learning word problems with GRPO, full
fine-tuning and LoRA, one run per seed.

    python results/smollm2_word_problems/summarize.py results/smollm2_word_problems/logs              # per run
    python results/smollm2_word_problems/summarize.py results/smollm2_word_problems/logs --markdown   # README table

From each run's ``metrics.jsonl``: greedy ``val/accuracy`` on the 64 held-out problems (no computation shared with
training) at step 0 (the checkpoint as published), at the last step and at the best validated step;
``val/accuracy_out_of_form`` (64 problems in wordings, names and items training never shows); the median step time
and the largest ``perf/cpu_memory_used_gb`` a step logged (the resident memory of the largest rank, GiB). Spread:
the sample standard deviation over the seeds (n - 1) and the range; a paired difference LoRA - full on each seed
where both ran."""

import json
import statistics
import sys
from pathlib import Path

VARIANTS = {"full": "full fine-tuning, lr 1e-5 (`configs/grpo_smollm2_gsm.yaml`)",
            "lora": "LoRA rank 16, alpha 32, lr 1e-4 (`configs/grpo_smollm2_gsm_lora.yaml`)"}


def run_figures(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    ood = {r["step"]: r["val/accuracy_out_of_form"] for r in rows if "val/accuracy_out_of_form" in r}
    steps = [r for r in rows if "timing_s/step" in r]
    if not val or not steps:
        raise SystemExit(f"{run}: expected validation rows and step rows in metrics.jsonl, found "
                         f"{len(val)} and {len(steps)}")
    return {"step0": val[0][1], "last": val[-1][1], "best": max(v for _, v in val), "last_step": val[-1][0],
            "gain": 100.0 * (val[-1][1] - val[0][1]), "ood0": ood[val[0][0]], "ood_last": ood[val[-1][0]],
            "ood_gain": 100.0 * (ood[val[-1][0]] - ood[val[0][0]]),
            "s_per_step": statistics.median(r["timing_s/step"] for r in steps),
            "peak_gb": max(r.get("perf/cpu_memory_used_gb", 0.0) for r in steps)}


def groups(logs: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for variant in VARIANTS:
        runs = sorted((p for p in logs.glob(f"{variant}_seed*") if p.is_dir()),
                      key=lambda p: int(p.name.rsplit("seed", 1)[1]))
        if runs:  # a variant not run yet (VARIANTS="...") has no row
            out[variant] = {int(p.name.rsplit("seed", 1)[1]): run_figures(p) for p in runs}
    return out


def spread(values: list[float], fmt: str) -> str:
    """mean ± sample sd [min, max] (one value: the value)."""
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    mean, sd = statistics.mean(values), statistics.stdev(values)
    return f"{mean:{fmt}} ± {sd:{fmt.replace('+', '')}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def lines(logs: Path) -> list[str]:
    out = []
    for variant, runs in groups(logs).items():
        for seed, f in runs.items():
            out.append(f"{variant} seed {seed}: val/accuracy {f['step0']:.3f} -> {f['last']:.3f} (step "
                       f"{f['last_step']}, {f['gain']:+.1f} points, best {f['best']:.3f}); out-of-form "
                       f"{f['ood0']:.3f} -> {f['ood_last']:.3f}; {f['s_per_step']:.1f} s/step; "
                       f"peak RSS {f['peak_gb']:.2f} GiB")
    return out


def markdown(logs: Path) -> list[str]:
    found = groups(logs)
    out = ["<!-- results/smollm2_word_problems:runs -->",
           "| run (mean ± sd [min, max] over the seeds) | seeds | val/accuracy at step 0 | at step 30 | gain (points) "
           "| best validated step | out-of-form, step 0 -> 30 (points) | s/step, median | RSS of the largest rank |",
           "|---|---|---|---|---|---|---|---|---|"]
    for variant, runs in found.items():
        col = {key: [f[key] for f in runs.values()] for key in next(iter(runs.values()))}
        out.append(f"| {VARIANTS[variant]} | {', '.join(map(str, runs))} | {spread(col['step0'], '.3f')} | "
                   f"{spread(col['last'], '.3f')} | {spread(col['gain'], '+.1f')} | {spread(col['best'], '.3f')} | "
                   f"{spread(col['ood_gain'], '+.1f')} | {statistics.median(col['s_per_step']):.1f} | "
                   f"{max(col['peak_gb']):.2f} GiB |")
    both = sorted(set(found.get("full", {})) & set(found.get("lora", {})))
    if both:
        diff = [found["lora"][s]["gain"] - found["full"][s]["gain"] for s in both]
        out += ["", f"LoRA - full, gain on the same seed (points): {spread(diff, '+.1f')} "
                    f"({', '.join(f'{d:+.1f}' for d in diff)}; seeds {', '.join(map(str, both))})"]
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
