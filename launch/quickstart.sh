#!/usr/bin/env bash
# README command (A): set everything up and run the main CPU job.
# Today the main job is the environment report and the reshard-kernel benchmark; it grows into
# data -> SFT -> GRPO on a tiny model as the trainer lands (see the README).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launch/setup_env.sh
OUT="${VERL_OUTPUT_DIR:-outputs/quickstart}"
mkdir -p "$OUT"
.venv/bin/verl check-env
.venv/bin/verl bench kernels --json "$OUT/bench_kernels.json"
