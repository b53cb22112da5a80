#!/usr/bin/env bash
# The quickstart figure (README command A) over 3 seeds (issue 57 items 1-2): data -> SFT warm start -> 100 GRPO steps,
# each seed a fresh run whose trainer.seed also seeds the data split and the SFT stage (launch/quickstart.py:
# seed_overrides). Copies each run's metrics.jsonl, summary.json and SFT metrics next to this script (logs/), then
# prints the mean and spread (summarize.py). ~4 min a seed on 2 cores.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
for N in 0 1 2; do
  bash launch/quickstart.sh --fresh --out "outputs/qs_seed$N" "trainer.seed=$N"
  mkdir -p "$LOGS/seed$N"
  cp "outputs/qs_seed$N/metrics.jsonl" "outputs/qs_seed$N/summary.json" "$LOGS/seed$N/"
  cp "outputs/qs_seed$N/sft/metrics.jsonl" "$LOGS/seed$N/sft_metrics.jsonl"
done
bash "$HERE/machine.sh" > "$LOGS/machine.txt"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
