#!/usr/bin/env bash
# The quickstart with SGLang as the rollout against the native engine (issue 57: the README's SGLang figure with its
# raw logs, seeds and spread), 3 seeds each: data -> SFT warm start -> 100 GRPO steps of configs/grpo_arith_tiny.yaml,
# the same command but for actor_rollout_ref.rollout.name; trainer.seed=N seeds the data split, the SFT stage and RL,
# so both rollouts of a seed start from the same warm start. Run one after the other on an otherwise idle box (the
# step times are figures). Copies each run's metrics.jsonl and summary.json next to this script (logs/), then
# summarizes. ~3 min a native run, ~6 min an SGLang run on 2 cores.
# ROLLOUTS="sglang" or SEEDS="0" rerun a subset.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
mkdir -p "$LOGS"
for N in ${SEEDS:-0 1 2}; do
  for ROLLOUT in ${ROLLOUTS:-native sglang}; do
    OUT="outputs/qs_${ROLLOUT}_seed$N"
    bash launch/quickstart.sh --fresh --out "$OUT" "actor_rollout_ref.rollout.name=$ROLLOUT" "trainer.seed=$N" \
      > "$LOGS/${ROLLOUT}_seed$N.log" 2>&1
    rm -rf "$LOGS/${ROLLOUT}_seed$N" && mkdir -p "$LOGS/${ROLLOUT}_seed$N"
    cp "$OUT/metrics.jsonl" "$OUT/summary.json" "$LOGS/${ROLLOUT}_seed$N/"
  done
done
bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.txt"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
