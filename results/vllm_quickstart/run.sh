#!/usr/bin/env bash
# The quickstart with vLLM as the rollout against the native engine (issue 55 item 8: "learns like native, within 5
# points"), 3 seeds each: data -> SFT warm start -> 100 GRPO steps of the quickstart's MoE variant
# (configs/grpo_qwen3moe_tiny.yaml: head_dim 32; the default quickstart model's 16 is below vLLM's CPU attention
# sizes), the same command but for actor_rollout_ref.rollout.name; trainer.seed=N seeds the data split, the SFT stage
# and RL, so both rollouts of a seed start from the same warm start. Copies each run's metrics.jsonl and summary.json
# next to this script (logs/), then summarizes. ~8 min a run on 2 cores.
# ROLLOUTS="vllm" or SEEDS="0" rerun a subset.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
mkdir -p "$LOGS"
for N in ${SEEDS:-0 1 2}; do
  for ROLLOUT in ${ROLLOUTS:-native vllm}; do
    OUT="outputs/qs_moe_${ROLLOUT}_seed$N"
    bash launch/quickstart.sh --fresh --out "$OUT" --config configs/grpo_qwen3moe_tiny.yaml \
      "actor_rollout_ref.rollout.name=$ROLLOUT" "trainer.seed=$N" > "$LOGS/${ROLLOUT}_seed$N.log" 2>&1
    rm -rf "$LOGS/${ROLLOUT}_seed$N" && mkdir -p "$LOGS/${ROLLOUT}_seed$N"
    cp "$OUT/metrics.jsonl" "$OUT/summary.json" "$LOGS/${ROLLOUT}_seed$N/"
  done
done
bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.txt"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
