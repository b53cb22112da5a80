#!/usr/bin/env bash
# Issue 54 item 8: what a tiny 2-rank `verl train` spends from the launch to the end of its first step, with the
# ranks forked from the fork server (the default on a CPU host) and as fresh interpreters (VERL_RANK_START=exec,
# the way every rank started before), ROUNDS rounds alternating which mode goes first. Each run prints rank 0's
# `startup:` line (verl.launcher.startup) and the CPU seconds of all its processes. ~2 min on 2 idle cores. Writes logs/ next to this script.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
ROUNDS="${ROUNDS:-6}"
rm -rf "$LOGS" && mkdir -p "$LOGS"
bash "$ROOT/results/quickstart/machine.sh" > "$LOGS/machine.txt" 2>&1
.venv/bin/verl data arithmetic --out "$LOGS/work/arith" --num-train 64 --num-test 16 > /dev/null
run() {  # MODE ROUND
  local env=() out="$LOGS/work/out.$1.$2"
  [[ $1 == exec ]] && env=(VERL_RANK_START=exec)
  local TIMEFORMAT="cpu_s user %U sys %S wall %R"  # bash's `time`: every process of the run, ranks included
  { time env "${env[@]}" OMP_NUM_THREADS=1 .venv/bin/verl train --config configs/grpo_arith_tiny.yaml \
    data.train_files="$LOGS/work/arith/train.parquet" data.val_files="$LOGS/work/arith/test.parquet" \
    data.tokenizer="$LOGS/work/arith/tokenizer" trainer.output_dir="$out" trainer.total_training_steps=1 \
    trainer.save_freq=-1 trainer.val_before_train=false trainer.test_freq=-1 trainer.export_hf_at_end=false \
    > "$LOGS/$1.$2.log" 2>&1; } 2>> "$LOGS/$1.$2.log"
  grep -h '"perf/time_to_first_step_s"' "$out/metrics.jsonl" > /dev/null
}
for round in $(seq 1 "$ROUNDS"); do
  if ((round % 2)); then run fork "$round"; run exec "$round"; else run exec "$round"; run fork "$round"; fi
done
rm -rf "$LOGS/work"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
