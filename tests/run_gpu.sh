#!/usr/bin/env bash
# The GPU checks in one script, for a bare GPU machine (no network) that has a CUDA torch:
#   1. megatron-core (+ omegaconf, tensordict) from wheels carried in .whl/ (see below) into /tmp/verl-site;
#   2. verl._C built with CUDA (TORCH_CUDA_ARCH_LIST, default: this GPU's arch + sm_80/sm_90);
#   3. the GPU tier (tests/gpu: CUDA kernels incl. invalid programs, two ranks sharing the GPU over gloo:
#      reshard bit-exact and greedy = Megatron greedy after a train step) and the kernels tier;
#   4. figures: verl bench kernels --device cuda (bf16), the quickstart on 1 GPU (SFT -> GRPO), and 5 GRPO
#      steps of a Qwen2.5-0.5B-shaped model in bf16 (configs/grpo_qwen2_0p5b_gpu.yaml).
# Each stage prints its wall time; stages are separate commands so each fits a 10-minute limit:
#   bash tests/run_gpu.sh setup       # 1 + 2
#   bash tests/run_gpu.sh tests       # 3
#   bash tests/run_gpu.sh bench       # 4a
#   bash tests/run_gpu.sh quickstart  # 4b
#   bash tests/run_gpu.sh qwen05b     # 4c
#   bash tests/run_gpu.sh fsdp        # 4d: the FSDP backend: the quickstart's RL stage on 1 GPU (FSDP2 bf16 mixed
#                                     #     precision, fp32 master weights cast into a bf16 native rollout)
#   bash tests/run_gpu.sh manycore    # 5: issue 17's many-core half: GRPO steps of the 0.74M model on the host's
#                                     #    CPU cores (CUDA hidden), actor TP1 and TP2, vs the one-process HF baseline;
#                                     #    issue 31's async trainer modes on 8 ranks (long-tail bench, vs sync)
# Wheels, made on a machine with network (Python of the GPU image: 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform any -d .whl megatron-core==0.16.1 omegaconf hydra-core==1.3.2 \
#       tensordict==0.15.3 cloudpickle pyvers
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
# (tensordict 0.15.3, DataProto's batch, is pure Python and needs torch >= 2.11: the GPU image has 2.11.)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
SITE=/tmp/verl-site
export PYTHONPATH="$SITE:$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
export OUT="${OUT:-$ROOT/outputs/gpu}"
mkdir -p "$OUT"
stage="${1:-all}"
t0=$SECONDS
say() { printf '[run_gpu %4ds] %s\n' "$((SECONDS - t0))" "$*"; }

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "run_gpu: expected a CUDA device visible to torch, found none" >&2; exit 2; }

setup() {
  if ! "$PY" -c "import megatron.core" 2>/dev/null; then
    ls .whl/*.whl >/dev/null 2>&1 || { echo "run_gpu: expected megatron-core wheels in .whl/, found none" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
  fi
  say "building verl._C with CUDA"
  MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  "$PY" -c "import verl._C as C; assert C.built_with_cuda(), 'verl._C has no CUDA'; print('verl._C with CUDA')"
  "$PY" -m verl.cli check-env || true
}

tests() {
  say "GPU tier + kernels tier"
  "$PY" -m pytest tests/gpu tests/kernels -p no:cacheprovider -q -rs --durations=10 2>&1 | tee "$OUT/pytest.log"
}

bench() {
  say "verl bench kernels --device cuda (bf16)"
  "$PY" -m verl.cli bench kernels --device cuda --dtype bfloat16 --sizes-mb 1,16,64,256,1024 \
    --json "$OUT/bench_kernels_cuda.json"
}

quickstart() {
  say "quickstart on 1 GPU: data -> SFT -> GRPO"
  "$PY" -m launch.quickstart --out "$OUT/quickstart" --sft-override trainer.nproc=1 \
    trainer.n_gpus_per_node=1 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
    2>&1 | tee "$OUT/quickstart.log"
}

qwen05b() {
  say "GRPO, Qwen2.5-0.5B shape, bf16, 1 GPU, 5 steps (configs/grpo_qwen2_0p5b_gpu.yaml)"
  [[ -f data/arithmetic/train.parquet ]] || "$PY" -m verl.cli data arithmetic --out data/arithmetic
  VERL_FILE_LOGGER_PATH="$OUT/qwen05b_metrics.jsonl" "$PY" -m verl.cli train \
    --config configs/grpo_qwen2_0p5b_gpu.yaml trainer.output_dir="$OUT/qwen05b" trainer.resume_mode=disable \
    2>&1 | tee "$OUT/qwen05b.log"
}
fsdp() {
  say "GRPO on FSDP2, 1 GPU, bf16 compute + bf16 rollout (configs/grpo_arith_tiny_fsdp.yaml)"
  [[ -f data/arithmetic/train.parquet ]] || "$PY" -m verl.cli data arithmetic --out data/arithmetic
  "$PY" -m verl.cli train --config configs/grpo_arith_tiny_fsdp.yaml trainer.n_gpus_per_node=1 \
    actor_rollout_ref.rollout.dtype=bfloat16 trainer.total_training_steps=20 trainer.output_dir="$OUT/fsdp" \
    trainer.resume_mode=disable 2>&1 | tee "$OUT/fsdp.log"
}
manycore() {
  say "CPU step speed on $(nproc) cores, CUDA hidden: verl bench train TP1 and TP2 vs --baseline hf"
  for tp in 1 2; do
    CUDA_VISIBLE_DEVICES= "$PY" -m verl.cli bench train --model configs/models/qwen2_0p7m_arith.json --steps 20 \
      --tp "$tp" --baseline hf --json "$OUT/manycore_tp$tp.json" algorithm.rollout_correction.bypass_mode=true \
      | "$PY" -c "import json,sys; r=json.load(sys.stdin); print('tp$tp', 's/step', round(r['s_per_step'], 4), 'hf', round(r['baseline']['s_per_step'], 4), 'speedup', round(r['speedup'], 2))"
  done
  # Issue 31's bench on the long-tail workload with the cores two could not give: 8 ranks in every mode
  # (separate_async: 6 training + 2 rollout ranks), tokens/s of each async mode against sync's.
  say "async trainer modes on $(nproc) cores, CUDA hidden: verl bench train --mode sync|colocate_async|separate_async"
  for mode in sync colocate_async separate_async; do
    CUDA_VISIBLE_DEVICES= "$PY" -m verl.cli bench train --mode "$mode" --nproc 8 --rollout-ranks 2 --prompts 48 --n 4 \
      --response-length 56 --steps 12 --json "$OUT/manycore_$mode.json" > "$OUT/manycore_$mode.log" 2>&1 \
      || { tail -20 "$OUT/manycore_$mode.log"; return 1; }
  done
  "$PY" - "$OUT" <<'PYEOF'
import json, sys
runs = {m: json.load(open(f"{sys.argv[1]}/manycore_{m}.json")) for m in ("sync", "colocate_async", "separate_async")}
for mode, r in runs.items():
    print(f"{mode:15s} s/step {r['s_per_step']:.4f} tokens/s {r['tokens_per_s']:.0f} "
          f"({r['tokens_per_s'] / runs['sync']['tokens_per_s']:.2f}x sync) trainer idle {r['trainer_idle_fraction']:.2f} "
          f"rollout idle {r['rollout_idle_fraction']:.2f} staleness {r['staleness_worst_mean']:.2f}")
PYEOF
}
case "$stage" in
  setup) setup ;;
  tests) tests ;;
  bench) bench ;;
  quickstart) quickstart ;;
  qwen05b) qwen05b ;;
  fsdp) fsdp ;;
  manycore) manycore ;;
  all) setup; tests; bench; quickstart; qwen05b; fsdp; manycore ;;
  *) echo "run_gpu: expected a stage among setup, tests, bench, quickstart, qwen05b, fsdp, manycore, all; found '$stage'" >&2
     exit 2 ;;
esac
say "done: $stage"
