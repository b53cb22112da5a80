"""Summarize results/quickstart/logs: the quickstart's greedy held-out accuracy per seed and its mean and spread.

    python results/quickstart/summarize.py results/quickstart/logs              # per seed, then mean +- sd
    python results/quickstart/summarize.py results/quickstart/logs --markdown   # the README tables, rebuilt

Every figure comes from a run's ``metrics.jsonl`` (``val/accuracy`` on the 256 in-distribution held-out problems,
``val/accuracy_out_of_form`` on the 128 out-of-form ones, ``timing_s/step``) and ``sft_metrics.jsonl`` (the SFT
export's own eval); wall times from its ``summary.json``. Spread: the sample standard deviation over the seeds
(n - 1) and the range."""

import json
import statistics
import sys
from pathlib import Path


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def seed_figures(run: Path) -> dict:
    rows = _jsonl(run / "metrics.jsonl")
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    ood = {r["step"]: r["val/accuracy_out_of_form"] for r in rows if "val/accuracy_out_of_form" in r}
    steps = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
    first, last = val[0], val[-1]
    best = max(val, key=lambda sv: (sv[1], -sv[0]))
    sft = [r["val/accuracy"] for r in _jsonl(run / "sft_metrics.jsonl") if "val/accuracy" in r]
    walls = json.loads((run / "summary.json").read_text())["wall_s"]
    return {"step0": first[1], "first_step": first[0], "last": last[1], "last_step": last[0], "best": best[1],
            "best_step": best[0], "gain": 100.0 * (last[1] - first[1]), "ood0": ood.get(first[0]),
            "ood_last": ood.get(last[0]), "n": next(r["val/num_samples"] for r in rows if "val/num_samples" in r),
            "n_ood": next((r["val/num_samples_out_of_form"] for r in rows if "val/num_samples_out_of_form" in r),
                          None),
            "sft_export": sft[-1] if sft else None, "s_per_step": statistics.median(steps),
            "wall": " + ".join(f"{v:.0f}" for v in walls.values())}


def runs(logs: Path) -> dict[int, dict]:
    return {int(p.name[4:]): seed_figures(p) for p in sorted(logs.glob("seed*")) if p.name[4:].isdigit()}


def spread(values: list[float], fmt: str) -> str:
    """mean ± sample sd [min, max]."""
    mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:{fmt}} ± {sd:{fmt.replace('+', '')}} [{min(values):{fmt}}, {max(values):{fmt}}]"


MEAN_ROWS = (("val/accuracy at step 0 (the SFT warm start)", "step0", ".3f"),
             ("val/accuracy at step 100 (last)", "last", ".3f"),
             ("val/accuracy, best validated step", "best", ".3f"),
             ("gain, step 0 -> 100 (points)", "gain", "+.1f"),
             ("out-of-form val/accuracy at step 0", "ood0", ".3f"),
             ("out-of-form val/accuracy at step 100", "ood_last", ".3f"))


def lines(logs: Path) -> list[str]:
    figures = runs(logs)
    out = []
    for seed, f in figures.items():
        out.append(f"seed {seed}: val/accuracy {f['step0']:.3f} (step {f['first_step']}) -> {f['last']:.3f} (step "
                   f"{f['last_step']}), best {f['best']:.3f} (step {f['best_step']}), {f['gain']:+.1f} points; "
                   f"out-of-form {f['ood0']} -> {f['ood_last']}; SFT export {f['sft_export']}; "
                   f"{f['s_per_step']:.3f} s/step; wall {f['wall']} s")
    for label, key, fmt in MEAN_ROWS:
        out.append(f"{label} over seeds {sorted(figures)}: {spread([f[key] for f in figures.values()], fmt)}")
    return out


def markdown(logs: Path) -> list[str]:
    figures = runs(logs)
    n, n_ood = {f["n"] for f in figures.values()}, {f["n_ood"] for f in figures.values()}
    out = ["<!-- results/quickstart:mean -->",
           f"| greedy held-out accuracy ({'/'.join(str(int(x)) for x in sorted(n))} problems; out-of-form: "
           f"{'/'.join(str(int(x)) for x in sorted(n_ood))}) | mean ± sd [min, max], seeds "
           f"{', '.join(str(s) for s in figures)} |", "|---|---|"]
    out += [f"| {label} | {spread([f[key] for f in figures.values()], fmt)} |" for label, key, fmt in MEAN_ROWS]
    out += ["", "<!-- results/quickstart:seeds -->",
            "| seed | step 0 | step 100 | best (step) | gain (points) | out-of-form, step 0 -> 100 | SFT export "
            "(its own eval) | s/step (median) | wall s: data + SFT + GRPO |", "|---|---|---|---|---|---|---|---|---|"]
    for seed, f in figures.items():
        out.append(f"| {seed} | {f['step0']:.3f} | {f['last']:.3f} | {f['best']:.3f} ({f['best_step']}) | "
                   f"{f['gain']:+.1f} | {f['ood0']:.3f} -> {f['ood_last']:.3f} | {f['sft_export']:.3f} | "
                   f"{f['s_per_step']:.3f} | {f['wall']} |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
