#!/usr/bin/env bash
# The real-model GRPO step with vLLM as the rollout beside the native rollout (issue 55): `verl bench train` on
# SmolLM2-135M-Instruct at its defaults (word problems in the chat template, 8 prompts x 4 samples, 32 new tokens,
# fp32, Megatron actor on 2 ranks, rollout TP 1 per rank), with actor_rollout_ref.rollout.name=native and =vllm,
# 7 steps each (2 warm-up, 5 measured), both orders. Both sides run from .venv-vllm (same torch, same transformers),
# so the rollout engine is the only difference. Needs launch/setup_env.sh and launch/setup_vllm.sh; ~15 min on
# 2 idle cores. Writes logs/ next to this script.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
{ bash "$ROOT/results/quickstart/machine.sh"; .venv-vllm/bin/python -c "import vllm, transformers; print('.venv-vllm (both runs): vllm', vllm.__version__, 'transformers', transformers.__version__)"; } \
    > "$LOGS/machine.txt" 2>&1
SMOL="$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests"); from helpers.real_model import smollm2_dir; print(smollm2_dir())')"
bench() {  # $1: rollout engine, $2: run name
  .venv-vllm/bin/verl bench train --model "$SMOL" --prompts 8 --n 4 --response-length 32 --steps 7 --warmup 2 \
      --workdir "$LOGS/$2.work" --json "$LOGS/$2.json" actor_rollout_ref.rollout.name="$1" > "$LOGS/$2.log" 2>&1
  mkdir -p "$LOGS/$2.metrics"
  cp "$LOGS/$2.work/out/metrics.jsonl" "$LOGS/$2.metrics/verl.jsonl"
  rm -rf "$LOGS/$2.work"  # data, checkpoints and the exported model
}
bench native native_a
bench vllm vllm_a
bench vllm vllm_b
bench native native_b
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
