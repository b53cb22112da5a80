#!/usr/bin/env bash
# verl-hpc vs TRL's GRPOTrainer at each side's defaults (issue 60): the same GRPO workload, same threads per rank on
# both sides (2 ranks each), each pair run in both orders (ours first, then TRL first).
#   real: SmolLM2-135M-Instruct, word problems in its chat template, 8 prompts x 4 samples, 32 new tokens, fp32,
#         7 steps (2 warm-up, 5 measured)
#   tiny: the 0.7M arithmetic Qwen2 (random init), 16 prompts x 4 samples, 4 new tokens, 12 steps (2 warm-up)
# TRL is not a dependency: it goes into a directory of its own (TRL_SITE, default /tmp/trl-site), put on
# PYTHONPATH for both sides' processes. ~30 min on 2 idle cores. Writes logs/ next to this script.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
SITE="${TRL_SITE:-/tmp/trl-site}"
if [[ ! -d "$SITE/trl" ]]; then
  .venv/bin/pip install -q --target "$SITE" --no-deps trl==1.16.0 datasets dill multiprocess xxhash pandas
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# RUNS="name ..." redoes only those runs (one killed on a loaded machine) and keeps the others' logs
ONLY="${RUNS:-}"
if [[ -z "$ONLY" ]]; then rm -rf "$LOGS"; fi
mkdir -p "$LOGS"
MACHINE=machine  # a rerun's record beside the earlier ones: machine.rerun1.txt, machine.rerun2.txt, ...
if [[ -n "$ONLY" ]]; then n=1; while [[ -e "$LOGS/machine.rerun$n.txt" ]]; do n=$((n + 1)); done; MACHINE="machine.rerun$n"; fi
{ bash "$ROOT/results/quickstart/machine.sh"; .venv/bin/python -c "import trl; print('trl', trl.__version__)"; } \
    > "$LOGS/$MACHINE.txt" 2>&1
SMOL="$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests"); from helpers.real_model import smollm2_dir; print(smollm2_dir())')"
bench() {  # $1: name, then verl bench train arguments
  local name="$1"; shift
  if [[ -n "$ONLY" && " $ONLY " != *" $name "* ]]; then return 0; fi
  rm -rf "$LOGS/$name".*
  .venv/bin/verl bench train --baseline trl --workdir "$LOGS/$name.work" --json "$LOGS/$name.json" "$@" \
      > "$LOGS/$name.log" 2>&1
  # keep the per-step metrics of both sides and the console logs; drop data, checkpoints and exported models
  mkdir -p "$LOGS/$name.metrics"
  cp "$LOGS/$name.work/out/metrics.jsonl" "$LOGS/$name.metrics/verl.jsonl"
  cp "$LOGS/$name.work/baseline_metrics.jsonl" "$LOGS/$name.metrics/trl.jsonl"
  rm -rf "$LOGS/$name.work"
}
REAL=(--model "$SMOL" --prompts 8 --n 4 --response-length 32 --steps 7 --warmup 2)
TINY=(--model configs/models/qwen2_0p7m_arith.json --prompts 16 --n 4 --response-length 4 --steps 12 --warmup 2)
bench real_verl_first "${REAL[@]}"
bench real_trl_first "${REAL[@]}" --baseline-first
# TRL with its linears on oneDNN as verl-hpc's engines run theirs (not a TRL option: verl.ops.cpu_gemm on its
# model), so the ratio separates the framework from the GEMM library
bench real_tuned_verl_first "${REAL[@]}" --baseline-linears onednn
bench real_tuned_trl_first "${REAL[@]}" --baseline-linears onednn --baseline-first
bench tiny_verl_first "${TINY[@]}"
bench tiny_trl_first "${TINY[@]}" --baseline-first
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
