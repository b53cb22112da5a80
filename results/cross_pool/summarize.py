"""Summarize results/cross_pool/logs: the cross-pool sync against the peers' bucketed broadcast and the unbucketed
one, per model and layout (two runs each, every sync verified).

    python results/cross_pool/summarize.py results/cross_pool/logs              # the summary
    python results/cross_pool/summarize.py results/cross_pool/logs --markdown   # the docs table, rebuilt"""

import json
import sys
from pathlib import Path

PARAMS = {"qwen2_100m": "0.10B", "qwen2_200m": "0.20B", "qwen2p5_0p5b": "0.49B", "qwen2_1b": "1.17B"}


def rows(logs: Path) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(logs.glob("*.json")):
        r = json.loads(path.read_text())
        if not (r["verified"] and r["naive_verified"] and r["bucketed_verified"]):
            raise SystemExit(f"{path}: expected every sync verified, found one that was not")
        model = Path(r["model"]).stem
        layout = f"{r['train']} -> tp={r['rollout']['tp']} x {r['rollout_replicas']}"
        out.setdefault((model, layout), []).append(r)
    return out


def markdown(logs: Path) -> list[str]:
    out = ["<!-- results/cross_pool:bucketed -->",
           "| model | training -> rollout (4 ranks) | received / pool rank | byte ratio | seconds | bucketed "
           "(peers') | bucketed / ours | unbucketed | unbucketed / ours |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (model, layout), runs in sorted(rows(logs).items(), key=lambda kv: (list(PARAMS).index(kv[0][0]), kv[0][1])):
        def both(key, fmt, suffix="", runs=runs):
            return ", ".join(f"{r[key]:{fmt}}{suffix}" for r in runs)

        received = max(runs[0]["bytes_received_per_rank"]) / 1e6
        out.append(f"| {PARAMS.get(model, model)} `{model}` | {layout} | {received:.1f} MB | "
                   f"{runs[0]['byte_ratio']:.1f} | {both('seconds', '.3f')} | {both('bucketed_seconds', '.3f')} | "
                   f"{both('bucketed_over_seconds', '.2f', 'x')} | {both('naive_seconds', '.3f')} | "
                   f"{both('naive_over_seconds', '.2f', 'x')} |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "logs"))))
