#!/usr/bin/env bash
# README command (B): set everything up, then run every test tier
# (unit, distributed, kernels, sglang, slurm). Extra arguments go to pytest, e.g.
#   bash tests/run_all.sh -m "unit or kernels"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launch/setup_env.sh
# Bytecode for the checkout (this image sets PYTHONDONTWRITEBYTECODE, so without it every rank process
# compiles verl from source: ~0.35 s of each of the suite's hundreds of process starts).
.venv/bin/python -m compileall -q -j 0 verl tests launch >/dev/null
# The full suite (no arguments: what CI runs) builds the SGLang environment (launch/setup_sglang.sh, ~3 min
# cold, mostly downloads) in the background while the first tiers run; the sglang tier runs the same
# script, which waits on its lock and then finds it done.
if [[ $# -eq 0 ]]; then
  bash launch/setup_sglang.sh > .venv-sglang.install.log 2>&1 &
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# pytest exits 5 when it collects nothing: that is a failure here, as is any other non-zero code.
exec .venv/bin/python -m pytest tests -p no:cacheprovider --durations=15 "$@"
