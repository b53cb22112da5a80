"""Summarize results/lora_vs_full/logs: LoRA r16 against full fine-tuning, each order's JSON from
launch/bench_lora_vs_full.py (both `verl bench train` records and their ratios).

    python results/lora_vs_full/summarize.py results/lora_vs_full/logs              # the table
    python results/lora_vs_full/summarize.py results/lora_vs_full/logs --markdown   # the same, with its marker

Medians over the measured steps of each run (after its warm-up step): s/step, update_actor, gen and update_weights;
the largest rank's peak RSS; the CPU seconds of every process of the whole command (the load-independent figure).
Both sides did the same first-step work (prompts, sampled lengths, tokens, score), checked by the harness."""

import json
import sys
from pathlib import Path

ORDERS = ("full-first", "lora-first")
ROWS = (("s/step", lambda r: r["s_per_step"], "{:.2f}"),
        ("update_actor s", lambda r: r["phases"].get("update_actor", 0.0), "{:.2f}"),
        ("gen s", lambda r: r["phases"].get("gen", 0.0), "{:.2f}"),
        ("update_weights s", lambda r: r["phases"].get("update_weights", 0.0), "{:.3f}"),
        ("peak RSS, largest rank, GiB", lambda r: r["peak_rss_gb"], "{:.2f}"),
        ("CPU seconds, whole command", lambda r: r["cpu_s"], "{:.1f}"))


def markdown(logs: Path) -> list[str]:
    runs = {order: json.loads((logs / f"{order}.json").read_text()) for order in ORDERS}
    for order, run in runs.items():
        if not run.get("same_first_step_work"):
            raise SystemExit(f"{logs}/{order}.json: the two sides' first steps did different work")
    first = runs[ORDERS[0]]["full"]
    # verl bench train's record keeps the measured response lengths under "response_length"; the budget asked for
    # is in the harness's command line, echoed first in its log.
    command = (logs / f"{ORDERS[0]}.log").read_text().split()
    new_tokens = command[command.index("--response-length") + 1]
    out = ["<!-- results/lora_vs_full:same_run -->",
           f"| SmolLM2-135M-Instruct, {first['prompts']} x {first['n']}, {new_tokens} new tokens, "
           f"{first['nproc']} ranks, {first['measured_steps']} measured steps | order | full | LoRA r16 | LoRA/full |",
           "|---|---|---|---|---|"]
    for label, get, fmt in ROWS:
        for order, run in runs.items():
            full, lora = get(run["full"]), get(run["lora"])
            out.append(f"| {label} | {order} | {fmt.format(full)} | {fmt.format(lora)} | "
                       f"{lora / full if full else float('nan'):.2f} |")
    return out


if __name__ == "__main__":
    table = markdown(Path(sys.argv[1]))
    print("\n".join(table if "--markdown" in sys.argv[2:] else table[1:]))
