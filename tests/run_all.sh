#!/usr/bin/env bash
# README command (B): set everything up, then run every test tier
# (unit, distributed, kernels, sglang, slurm). Extra arguments go to pytest, e.g.
#   bash tests/run_all.sh -m "unit or kernels"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launch/setup_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# pytest exits 5 when it collects nothing: that is a failure here, as is any other non-zero code.
exec .venv/bin/python -m pytest tests -p no:cacheprovider --durations=15 "$@"
