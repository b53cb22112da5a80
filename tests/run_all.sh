#!/usr/bin/env bash
# README command (B): set everything up, then run every test tier
# (unit, distributed, kernels, sglang, vllm, slurm). Extra arguments go to pytest, e.g.
#   bash tests/run_all.sh -m "unit or kernels"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launch/setup_env.sh
# Bytecode for the checkout (this image sets PYTHONDONTWRITEBYTECODE, so without it every rank process
# compiles verl from source: ~0.35 s of each of the suite's hundreds of process starts).
.venv/bin/python -m compileall -q -j 0 verl tests launch >/dev/null
# The full suite (no arguments: what CI runs) builds the SGLang and vLLM environments (launch/setup_sglang.sh,
# launch/setup_vllm.sh, ~2-3 min each cold, mostly downloads) in the background while the first tiers run; their
# tiers run the same scripts, which wait on their locks and then find them done. One after the other: each ends by
# hard-linking its copies of torch and triton to the venvs already built, so the disk never holds all three copies
# at once (10.8 GB at the peak when both installed together, of a CI disk that ran out once).
if [[ $# -eq 0 ]]; then
  # a failure here is reported by the tier, which runs its script again
  { bash launch/setup_sglang.sh > .venv-sglang.install.log 2>&1 || true
    bash launch/setup_vllm.sh > .venv-vllm.install.log 2>&1 || true; } &
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
DURATIONS="--durations=${VERL_TEST_DURATIONS:-15}"
# pytest exits 5 when it collects nothing: that is a failure here, as is any other non-zero code.
if [[ $# -gt 0 ]]; then
  exec .venv/bin/python -m pytest tests -p no:cacheprovider "$DURATIONS" "$@"
fi
# The full suite: the Slurm tier runs beside the others. Most of its wall time is waiting (Slurm daemons'
# heartbeats and requeue delays, a cut link's collective timeout, the launcher's bounds after a kill), which left
# the 2 cores idle when the tiers ran one after another. Its own base temp dir, so neither session's cleanup of
# old pytest dirs can reach the other's; its report is printed after the rest's.
SLURM_LOG="$ROOT/.slurm-tier.log"
.venv/bin/python -m pytest tests/slurm -p no:cacheprovider "$DURATIONS" --basetemp=/tmp/verl-slurm-tier \
    > "$SLURM_LOG" 2>&1 &
slurm_pid=$!
trap 'kill "$slurm_pid" 2>/dev/null || true' INT TERM
set +e
.venv/bin/python -m pytest tests --ignore=tests/slurm -p no:cacheprovider "$DURATIONS"
rest=$?
wait "$slurm_pid"
slurm=$?
set -e
echo "================================ the Slurm tier (ran beside the others) ================================"
cat "$SLURM_LOG"
echo "run_all: the Slurm tier exited $slurm, the other tiers $rest"
if [[ $rest -ne 0 ]]; then exit "$rest"; fi
exit "$slurm"
