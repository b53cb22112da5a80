#!/usr/bin/env bash
# The vLLM rollout's figures (issue 55): rollout tokens/s of native / SGLang / vLLM on the real SmolLM2-135M-Instruct
# and a tiny model, and GRPO with rollout.name=native vs vllm on the 0.7M arithmetic Qwen2 (head_dim 32), 5 steps
# each, run in both orders. Writes everything next to this script (logs/). Needs launch/setup_env.sh,
# launch/setup_sglang.sh and launch/setup_vllm.sh; ~10 min on 2 idle cores.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
{ date -u; uname -a; nproc; .venv/bin/python -c "import torch; print('torch', torch.__version__)";
  .venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"; git rev-parse HEAD; } > "$LOGS/machine.txt" 2>&1
SMOL="$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests"); from helpers.real_model import smollm2_dir; print(smollm2_dir())')"
.venv/bin/verl bench rollout --model "$SMOL" --batch 8 --prompt-len 64 --new-tokens 64 --repeats 3 --threads 2 \
    --json "$LOGS/bench_rollout_smollm2.json" 2>&1 | grep -v "WARNING\|INFO" | tee "$LOGS/bench_rollout_smollm2.log"
.venv/bin/verl bench rollout --model configs/models/qwen2_0p7m_arith.json --batch 16 --prompt-len 16 --new-tokens 32 \
    --repeats 3 --json "$LOGS/bench_rollout_tiny.json" 2>&1 | grep -v "WARNING\|INFO" | tee "$LOGS/bench_rollout_tiny.log"
.venv-vllm/bin/verl data arithmetic --out "$LOGS/data" --num-train 200 --num-test 16 > /dev/null
train() {  # $1: rollout engine, $2: run name
  .venv-vllm/bin/verl train --config configs/grpo_arith_tiny.yaml data.train_files="$LOGS/data/train.parquet" \
    data.val_files="$LOGS/data/test.parquet" data.tokenizer="$LOGS/data/tokenizer" \
    actor_rollout_ref.model.path=configs/models/qwen2_0p7m_arith.json actor_rollout_ref.rollout.name="$1" \
    trainer.total_training_steps=5 trainer.save_freq=-1 trainer.seed=0 trainer.output_dir="$LOGS/$2" \
    > "$LOGS/$2.log" 2>&1
}
for order in 1 2; do  # both orders, so neither engine always runs on a cooler machine
  if [[ $order == 1 ]]; then train native native_a; train vllm vllm_a; else train vllm vllm_b; train native native_b; fi
done
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
# Kept: each run's metrics.jsonl and console log (the exported models, TensorBoard files and data are regenerated)
for run in native_a vllm_a vllm_b native_b; do find "$LOGS/$run" -mindepth 1 -maxdepth 1 ! -name metrics.jsonl -exec rm -rf {} +; done
rm -rf "$LOGS/data"
