#!/usr/bin/env bash
# The README's real-model job, 3 seeds: SmolLM2-135M-Instruct, GRPO on generated GSM8K-format word problems (no SFT
# stage), full fine-tuning (configs/grpo_smollm2_gsm.yaml) and LoRA rank 16 (configs/grpo_smollm2_gsm_lora.yaml),
# 30 steps each; trainer.seed=N seeds the problems and their split (held out by computation, plus the out-of-form
# set) and the RL batch order. Copies each run's metrics.jsonl, summary.json and console log next to this script
# (logs/), then summarizes. ~15-20 min a run on 2 idle cores. VARIANTS="lora" or SEEDS="0" reruns a subset.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
VARIANTS="${VARIANTS:-full lora}"
SEEDS="${SEEDS:-0 1 2}"
mkdir -p "$LOGS"
for VARIANT in $VARIANTS; do
  case "$VARIANT" in
    full) CONFIG=configs/grpo_smollm2_gsm.yaml ;;
    lora) CONFIG=configs/grpo_smollm2_gsm_lora.yaml ;;
    *) echo "run.sh: expected VARIANTS among full lora, found $VARIANT" >&2; exit 2 ;;
  esac
  for N in $SEEDS; do
    OUT="outputs/wp_${VARIANT}_seed$N"
    bash launch/quickstart.sh --fresh --config "$CONFIG" --out "$OUT" "trainer.seed=$N" \
      > "$LOGS/${VARIANT}_seed$N.log" 2>&1
    rm -rf "$LOGS/${VARIANT}_seed$N" && mkdir -p "$LOGS/${VARIANT}_seed$N"
    cp "$OUT/metrics.jsonl" "$OUT/summary.json" "$LOGS/${VARIANT}_seed$N/"
    bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.${VARIANT}_seed$N.txt"
  done
done
bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.txt"  # the machine of the last run (each run's beside it)
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
