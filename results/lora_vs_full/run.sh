#!/usr/bin/env bash
# LoRA against full fine-tuning in one command (launch/bench_lora_vs_full.py: `verl bench train` twice on the same
# data, batch, ranks and seed), on the real SmolLM2-135M-Instruct at the word-problem job's batch (4 prompts x 8, 64
# new tokens), 2 ranks, Megatron TP 1, fp32, LoRA r16 on every linear; 1 warm-up step and 3 measured steps a side; run
# in both orders on an otherwise idle box (the load drifts between two runs: both orders show how much). Writes each
# order's console log and JSON (both records and the ratios) to logs/, then summarizes. ~12 min on 2 cores.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
mkdir -p "$LOGS"
for ORDER in full-first lora-first; do
  .venv/bin/python launch/bench_lora_vs_full.py --model .cache/smollm2-135m-instruct --prompts 4 --n 8 \
    --response-length 64 --steps 4 --warmup 1 --lora-rank 16 --order "$ORDER" --json "$LOGS/$ORDER.json" \
    > "$LOGS/$ORDER.log" 2>&1
done
bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.txt"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
