"""Summarize results/roofline/logs: each phase of the real-model GRPO step against the machine's measured limits.

    python results/roofline/summarize.py results/roofline/logs              # the summary
    python results/roofline/summarize.py results/roofline/logs --markdown   # the README table, rebuilt"""

import json
import sys
from pathlib import Path


def markdown(logs: Path) -> list[str]:
    r = json.loads((logs / "smollm2.json").read_text())["roofline"]
    m = r["machine"]
    out = ["<!-- results/roofline:phases -->",
           f"| phase (median of the measured steps) | measured s | bound s ({m['matmul_gflops']:.1f} GFLOP/s matmul, "
           f"{m['copy_gb_s']:.1f} GB/s copy, {m['threads']} threads) | fraction of the machine |",
           "|---|---|---|---|"]
    for name, p in sorted(r["phases"].items(), key=lambda kv: kv[1]["fraction"]):
        out.append(f"| {name} | {p['seconds']:.2f} | {p['bound_s']:.2f} | {p['fraction']:.1%} |")
    return out


if __name__ == "__main__":
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "logs")
    if "--markdown" in sys.argv:
        print("\n".join(markdown(logs)))
    else:
        print((logs / "smollm2.log").read_text().split("machine:", 1)[-1].split("{", 1)[0].strip())
