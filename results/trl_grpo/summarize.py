"""Summarize results/trl_grpo/logs: verl-hpc vs TRL's GRPOTrainer at defaults, each workload run in both orders; and
on the real checkpoint against TRL with its linears on oneDNN (the GEMM library verl-hpc's engines use).

    python results/trl_grpo/summarize.py results/trl_grpo/logs              # the summary lines
    python results/trl_grpo/summarize.py results/trl_grpo/logs --markdown   # the README tables, rebuilt

Per run: the median s/step over the measured steps (the bench's ``--warmup`` first steps left out) with its
range, tokens/s, and the largest process's peak RSS on each side; speedup = TRL's s/step over ours (> 1: verl-hpc is
faster). ``--markdown`` prints each README table after its marker (tests/unit/test_results_tables.py holds the
README to it)."""

import json
import sys
from pathlib import Path

RUNS = {"real_verl_first": ("SmolLM2-135M-Instruct, 8 x 4, 32 new tokens", "verl-hpc first"),
        "real_trl_first": ("SmolLM2-135M-Instruct, 8 x 4, 32 new tokens", "TRL first"),
        "real_tuned_verl_first": ("SmolLM2-135M-Instruct, 8 x 4, 32 new tokens, TRL's linears on oneDNN",
                                  "verl-hpc first"),
        "real_tuned_trl_first": ("SmolLM2-135M-Instruct, 8 x 4, 32 new tokens, TRL's linears on oneDNN",
                                 "TRL first"),
        "tiny_verl_first": ("0.7M arithmetic Qwen2, 16 x 4, 4 new tokens", "verl-hpc first"),
        "tiny_trl_first": ("0.7M arithmetic Qwen2, 16 x 4, 4 new tokens", "TRL first")}


def record(logs: Path, run: str) -> dict:
    return json.loads((logs / f"{run}.json").read_text())


def _side(r: dict) -> str:
    lo, hi = r["s_per_step_range"]
    return f"{r['s_per_step']:.3f} ({lo:.3f}-{hi:.3f})"


def lines(logs: Path) -> list[str]:
    out = []
    for run in RUNS:
        r = record(logs, run)
        b = r["baseline"]
        out.append(f"{run}: verl {_side(r)} s/step, {r['tokens_per_s']:.0f} tok/s, peak {r['peak_rss_gb']:.2f} GB; "
                   f"TRL {_side(b)} s/step, {b['tokens_per_s']:.0f} tok/s, peak {b['peak_rss_gb']:.2f} GB; "
                   f"speedup {r['speedup']:.2f}x over {r['measured_steps']} / {b['measured_steps']} measured steps; "
                   f"verl phases {', '.join(f'{k} {v:.2f}' for k, v in sorted(r['phases'].items()))}")
    return out


def markdown(logs: Path) -> list[str]:
    out = ["<!-- results/trl_grpo:defaults -->",
           "| workload | order | verl-hpc s/step, median (range) | TRL s/step, median (range) | speedup | "
           "tokens/s verl-hpc / TRL | peak RSS per rank verl-hpc / TRL |",
           "|---|---|---|---|---|---|---|"]
    for run, (workload, order) in RUNS.items():
        if run.startswith("real_tuned"):
            continue  # their own table below
        r = record(logs, run)
        b = r["baseline"]
        out.append(f"| {workload} | {order} | {_side(r)} | {_side(b)} | {r['speedup']:.2f}x | "
                   f"{r['tokens_per_s']:.0f} / {b['tokens_per_s']:.0f} | {r['peak_rss_gb']:.2f} / "
                   f"{b['peak_rss_gb']:.2f} GB |")
    out += ["", "<!-- results/trl_grpo:onednn_baseline -->",
            "| workload | order | verl-hpc s/step, median (range) | TRL on oneDNN s/step, median (range) | speedup | "
            "tokens/s verl-hpc / TRL | peak RSS per rank verl-hpc / TRL |",
            "|---|---|---|---|---|---|---|"]
    for run, (workload, order) in RUNS.items():
        if not run.startswith("real_tuned"):
            continue
        r = record(logs, run)
        b = r["baseline"]
        out.append(f"| {workload.split(', TRL')[0]} | {order} | {_side(r)} | {_side(b)} | {r['speedup']:.2f}x | "
                   f"{r['tokens_per_s']:.0f} / {b['tokens_per_s']:.0f} | {r['peak_rss_gb']:.2f} / "
                   f"{b['peak_rss_gb']:.2f} GB |")
    return out


if __name__ == "__main__":
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "logs")
    print("\n".join(markdown(logs) if "--markdown" in sys.argv else lines(logs)))
