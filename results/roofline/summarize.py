"""Summarize results/roofline/logs: each phase of the real-model GRPO step against the machine's measured limits,
with torch's BLAS path (VERL_CPU_GEMM=torch, ``smollm2_blas``) and with the default oneDNN path (``smollm2``).

    python results/roofline/summarize.py results/roofline/logs              # the summary
    python results/roofline/summarize.py results/roofline/logs --markdown   # the README table, rebuilt"""

import json
import sys
from pathlib import Path

RUNS = (("smollm2_blas", "torch's BLAS"), ("smollm2", "oneDNN (default)"))


def _roofline(logs: Path, run: str) -> dict:
    return json.loads((logs / f"{run}.json").read_text())["roofline"]


def markdown(logs: Path) -> list[str]:
    blas, onednn = (_roofline(logs, run) for run, _ in RUNS)
    m = onednn["machine"]
    libraries = ", ".join(f"{k.removeprefix('matmul_gflops_')} {v:.1f}" for k, v in m.items()
                          if k.startswith("matmul_gflops_"))
    out = ["<!-- results/roofline:phases -->",
           f"| phase (median of the measured steps) | measured s, {RUNS[0][1]} | measured s, {RUNS[1][1]} | "
           f"bound s ({m['matmul_gflops']:.1f} GFLOP/s matmul [{libraries}], {m['copy_gb_s']:.1f} GB/s copy, "
           f"{m['threads']} threads) | fraction of the machine, BLAS / oneDNN |",
           "|---|---|---|---|---|"]
    for name, p in sorted(onednn["phases"].items(), key=lambda kv: kv[1]["fraction"]):
        b = blas["phases"][name]
        out.append(f"| {name} | {b['seconds']:.2f} | {p['seconds']:.2f} | {p['bound_s']:.2f} | "
                   f"{p['bound_s'] / b['seconds']:.1%} / {p['fraction']:.1%} |")
    return out


if __name__ == "__main__":
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "logs")
    if "--markdown" in sys.argv:
        print("\n".join(markdown(logs)))
    else:
        for run, label in RUNS:
            text = (logs / f"{run}.log").read_text().split("machine:", 1)[-1].split("{", 1)[0].strip()
            print(f"{label}:\nmachine: {text}\n")
