#!/usr/bin/env bash
# The README's agentic figure over 3 seeds (issue 57 item 2): SmolLM2-135M-Instruct with the calculator tool, verl's
# tool_agent loop, GRPO after a 2-step SFT warm-up (configs/sft_smollm2_calculator.yaml,
# configs/agent_smollm2_calculator.yaml). Seed N draws the problems and their split (`verl data calculator-problems
# --seed N`: held out by computation, no training problem has a held-out problem's expression), the SFT order, the
# RL batch order and sampling. Copies each run's metrics (SFT and RL) and console log next to this script
# (logs/), then summarizes. ~10 min a seed on 2 idle cores. SEEDS="0" reruns a subset.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
SEEDS="${SEEDS:-0 1 2}"
VERL=.venv/bin/verl
mkdir -p "$LOGS"
for N in $SEEDS; do
  OUT="outputs/agentic_seed$N"
  rm -rf "$OUT" "$LOGS/seed$N" && mkdir -p "$OUT" "$LOGS/seed$N"
  {
    "$VERL" data calculator-problems --out "$OUT/data" --seed "$N"
    "$VERL" sft --config configs/sft_smollm2_calculator.yaml "trainer.seed=$N" "trainer.output_dir=$OUT/sft" \
      "data.train_files=$OUT/data/sft_train.parquet" "data.val_files=$OUT/data/sft_test.parquet"
    "$VERL" train --config configs/agent_smollm2_calculator.yaml "trainer.seed=$N" "data.seed=$N" \
      "actor_rollout_ref.model.path=$OUT/sft/hf" "trainer.output_dir=$OUT/rl" \
      "trainer.validation_data_dir=$OUT/rl/val_generations" \
      "data.train_files=$OUT/data/train.parquet" "data.val_files=$OUT/data/test.parquet"
  } > "$LOGS/seed$N.log" 2>&1
  cp "$OUT/rl/metrics.jsonl" "$LOGS/seed$N/"
  cp "$OUT/sft/metrics.jsonl" "$LOGS/seed$N/sft_metrics.jsonl"
  bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.seed$N.txt"
  rm -rf "$OUT/sft/hf" "$OUT/sft/checkpoints" "$OUT/rl/checkpoints" "$OUT/rl/actor_hf"  # ~1.6 GB a seed; the entry keeps metrics only
done
bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.txt"  # the machine of the last run (each run's beside it)
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
