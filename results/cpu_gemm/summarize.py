"""Summarize results/cpu_gemm/logs/gemm.json (`verl bench gemm`).

    python results/cpu_gemm/summarize.py results/cpu_gemm/logs              # the summary lines
    python results/cpu_gemm/summarize.py results/cpu_gemm/logs --markdown   # README.md's table, rebuilt

``--markdown`` prints the table of this directory's README.md after its marker line (``<!-- results/... -->``);
tests/unit/test_results_tables.py checks that the README's table is this, digit for digit."""

import json
import sys
from pathlib import Path


def records(logs: Path) -> list[dict]:
    return json.loads((logs / "gemm.json").read_text())["records"]


def lines(logs: Path) -> list[str]:
    return [f"{r['label']}: {r['m']} x {r['k']} x {r['n']}, torch {r['torch_gflops']:.0f} GFLOP/s, oneDNN "
            f"{r['onednn_gflops']:.0f} GFLOP/s, {r['speedup']:.2f}x, max rel diff {r['max_rel_diff']:.1e}"
            for r in records(logs)]


def markdown(logs: Path) -> list[str]:
    out = ["<!-- results/cpu_gemm:gemm -->",
           "| shape (SmolLM2-135M) | M x K x N | torch `F.linear` (MKL) | oneDNN (`mkldnn_linear`, weight prepacked) "
           "| oneDNN / torch | max relative difference |", "|---|---|---|---|---|---|"]
    for r in records(logs):
        out.append(f"| {r['label']} | {r['m']} x {r['k']} x {r['n']} | {r['torch_gflops']:.0f} GFLOP/s | "
                   f"{r['onednn_gflops']:.0f} GFLOP/s | {r['speedup']:.2f}x | {r['max_rel_diff']:.1e} |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
