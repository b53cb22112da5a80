#!/usr/bin/env bash
# The README's "rewards off the critical path" figure (issue 57): `python -m verl.bench.reward_pool` (the tiny GRPO
# config on 2 CPU ranks, 32 prompts x 4 samples a step, a scorer sleeping 20 ms a sample, 4 steps: in the step vs
# reward.num_workers=4), ROUNDS times. Each round's JSON holds both sides' mean s/step and reward seconds over steps
# 2..4 and each step's mean score and response length (the same work on both sides). ~5 min on 2 idle cores.
# Writes logs/ next to this script.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
ROUNDS="${ROUNDS:-3}"
rm -rf "$LOGS" && mkdir -p "$LOGS"
bash "$ROOT/results/quickstart/machine.sh" > "$LOGS/machine.txt" 2>&1
for round in $(seq 1 "$ROUNDS"); do
  .venv/bin/python -m verl.bench.reward_pool --workers 4 --steps 4 --sleep-ms 20 --json "$LOGS/round$round.json" \
      > "$LOGS/round$round.log" 2>&1
done
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
