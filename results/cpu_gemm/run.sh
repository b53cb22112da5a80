#!/usr/bin/env bash
# fp32 GEMM on this CPU, torch's default BLAS (MKL) against oneDNN, on SmolLM2-135M's linear shapes at a GRPO step's
# sizes and the roofline's square matmul (issue 60: where the rollout and the update lose time). ~1 min on 2 idle
# cores. Writes logs/ next to this script.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
{ bash "$ROOT/results/quickstart/machine.sh"; grep -o -w -E "avx2|avx512f|avx512_bf16|amx_tile" /proc/cpuinfo | sort -u; } \
    > "$LOGS/machine.txt" 2>&1
.venv/bin/verl bench gemm --threads 2 --repeats 20 --json "$LOGS/gemm.json" | tee "$LOGS/gemm.log"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
