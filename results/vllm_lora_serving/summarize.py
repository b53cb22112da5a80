"""Summarize results/vllm_lora_serving/logs: generation seconds of 32 x (100 + 32) tokens on vLLM's CPU backend
without LoRA, with LoRA enabled but no adapter on the requests, and with the adapter served (median of 3).

    python results/vllm_lora_serving/summarize.py results/vllm_lora_serving/logs              # the summary
    python results/vllm_lora_serving/summarize.py results/vllm_lora_serving/logs --markdown   # the README table"""

import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(r"RESULT engine=(\w+) case=([\w ]+) seconds=([\d.]+) first_ids=(\[[\d, ]*\]) "
                  r"first_logprob=(-?[\d.]+)")


def cases(logs: Path) -> dict:
    out: dict = {}
    for mode in ("base", "lora"):
        for m in LINE.finditer((logs / f"{mode}.log").read_text()):
            key = (m.group(1), m.group(2))
            out.setdefault(key, {"seconds": [], "ids": m.group(4), "logprob": float(m.group(5))})
            out[key]["seconds"].append(float(m.group(3)))
    return out


def markdown(logs: Path) -> list[str]:
    found = cases(logs)
    base = statistics.median(found[("base", "no adapter")]["seconds"])
    rows = ["<!-- results/vllm_lora_serving:generate -->",
            "| engine | requests | generate s, median of 3 | vs the engine without LoRA | first response's first ids "
            "| its first log-prob |", "|---|---|---|---|---|---|"]
    for (engine, case), r in found.items():
        s = statistics.median(r["seconds"])
        label = "LoRA enabled" if engine == "lora" else "without LoRA"
        rows.append(f"| {label} | {case} | {s:.2f} | {s / base:.2f}x | {r['ids']} | {r['logprob']:.4f} |")
    return rows


if __name__ == "__main__":
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "logs")
    print("\n".join(markdown(logs)))
