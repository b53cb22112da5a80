"""Summarize results/reward_pool/logs: each round's `verl.bench.reward_pool --json` record, in the step vs the pool.

    python results/reward_pool/summarize.py results/reward_pool/logs              # the summary
    python results/reward_pool/summarize.py results/reward_pool/logs --markdown   # the README table, rebuilt"""

import json
import statistics
import sys
from pathlib import Path


def rounds(logs: Path) -> list[dict]:
    records = [json.loads(path.read_text()) for path in sorted(logs.glob("round*.json"))]
    if not records:
        raise SystemExit(f"{logs}: expected round*.json records of verl.bench.reward_pool, found none")
    return records


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def markdown(logs: Path) -> list[str]:
    records = rounds(logs)
    pool = next(k for k in records[0] if k.startswith("pool_"))
    ratio = [r[pool]["step"] / r["in_step"]["step"] for r in records]
    return ["<!-- results/reward_pool:critical_path -->",
            f"| {len(records)} rounds, median (min-max) | s/step | reward on the critical path, s |",
            "|---|---|---|",
            "| rewards in the step | " + spread([r["in_step"]["step"] for r in records]) + " | "
            + spread([r["in_step"]["reward"] for r in records]) + " |",
            f"| `reward.num_workers={pool.split('_')[1]}` | " + spread([r[pool]["step"] for r in records]) + " | "
            + spread([r[pool]["reward"] for r in records]) + " |",
            f"| pool / in the step | {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) | |",
            "| the same work on both sides, every round (each step's mean score and response length) | "
            + str(all(r["same_work"] for r in records)).lower() + " | |"]


if __name__ == "__main__":
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "logs")
    print("\n".join(markdown(logs)))
