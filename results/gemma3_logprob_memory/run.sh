#!/usr/bin/env bash
# Issue 58 item 4: peak RSS per rank of the actor's log-prob and entropy paths, Gemma 3 270M (vocab 262144) against
# SmolLM2-135M-Instruct (vocab 49152) at the same tokens per micro-batch: the Gemma GRPO config's micro-batch (8 rows
# of 176 prompt + 48 response tokens), one Megatron rank each, fp32; Gemma once more with the log-softmax in fixed
# chunks of 1024 tokens (the rule before chunks were sized by elements). ~4 min on 2 idle cores. Writes logs/ here.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
bash "$ROOT/results/quickstart/machine.sh" > "$LOGS/machine.txt" 2>&1
PY=(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests"); from helpers.real_model import smollm2_dir; from helpers.gemma3_model import gemma3_dir; print(smollm2_dir(), gemma3_dir())')
read -r SMOL GEMMA < <("${PY[@]}")
.venv/bin/python -m launch.bench_logprob_memory --model "$SMOL" --model "$GEMMA" --rows 8 --prompt-len 176 \
    --response-len 48 --fixed-chunk-tokens 1024 --json "$LOGS/memory.json" 2>&1 | tee "$LOGS/memory.log"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
