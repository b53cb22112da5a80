#!/usr/bin/env bash
# Each phase of verl-hpc's GRPO step against this machine's measured limits (issue 60 item 3): `verl bench train
# --roofline` on the real SmolLM2-135M-Instruct workload of results/trl_grpo (8 prompts x 4 samples, 32 new tokens,
# fp32, 2 ranks), 6 steps (2 warm-up), once with torch's BLAS in the engines (VERL_CPU_GEMM=torch) and once with the
# default oneDNN linears. ~6 min on 2 idle cores. Writes logs/ next to this script.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
bash "$ROOT/results/quickstart/machine.sh" > "$LOGS/machine.txt" 2>&1
SMOL="$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests"); from helpers.real_model import smollm2_dir; print(smollm2_dir())')"
roofline() {  # $1: run name; the environment picks the CPU GEMM library
  .venv/bin/verl bench train --model "$SMOL" --prompts 8 --n 4 --response-length 32 --steps 6 --warmup 2 --roofline \
      --workdir "$LOGS/work" --json "$LOGS/$1.json" > "$LOGS/$1.log" 2>&1
  cp "$LOGS/work/out/metrics.jsonl" "$LOGS/$1.metrics.jsonl"
  rm -rf "$LOGS/work"
}
VERL_CPU_GEMM=torch roofline smollm2_blas  # torch's default BLAS (MKL) path in the engines: the before
roofline smollm2                           # the default: fp32 CPU linears on oneDNN
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
