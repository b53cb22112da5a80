#!/usr/bin/env bash
# The quickstart with vLLM as the rollout against the native engine (issue 55 item 8: "learns like native, within 5
# points"), 3 seeds each: data -> SFT warm start -> 100 GRPO steps on the 0.7M arithmetic Qwen2 (head_dim 32; the
# default quickstart model's 16 is below vLLM's CPU attention sizes), the same command but for
# actor_rollout_ref.rollout.name; trainer.seed=N seeds the data split, the SFT stage and RL. Copies each run's
# metrics.jsonl and summary.json next to this script (logs/), then summarizes. ~6 min a run on 2 cores.
# ROLLOUTS="vllm" or SEEDS="0" rerun a subset.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
mkdir -p "$LOGS"
for N in ${SEEDS:-0 1 2}; do
  for ROLLOUT in ${ROLLOUTS:-native vllm}; do
    OUT="outputs/qs_${ROLLOUT}_0p7m_seed$N"
    bash launch/quickstart.sh --fresh --out "$OUT" --sft-override model.path=configs/models/qwen2_0p7m_arith.json \
      "actor_rollout_ref.rollout.name=$ROLLOUT" "trainer.seed=$N" > "$LOGS/${ROLLOUT}_seed$N.log" 2>&1
    rm -rf "$LOGS/${ROLLOUT}_seed$N" && mkdir -p "$LOGS/${ROLLOUT}_seed$N"
    cp "$OUT/metrics.jsonl" "$OUT/summary.json" "$LOGS/${ROLLOUT}_seed$N/"
  done
done
bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.txt"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
