#!/usr/bin/env bash
# The GPU checks in one script, for a bare GPU machine (no network) that has a CUDA torch:
#   1. megatron-core (+ omegaconf, tensordict) from wheels carried in .whl/ (see below) into /tmp/verl-site;
#   2. verl._C built with CUDA (TORCH_CUDA_ARCH_LIST, default: this GPU's arch + sm_80/sm_90);
#   3. the GPU tier (tests/gpu: CUDA kernels incl. invalid programs, two ranks sharing the GPU over gloo:
#      reshard bit-exact and greedy = Megatron greedy after a train step) and the kernels tier;
#   4. figures: verl bench kernels --device cuda (bf16), the quickstart on 1 GPU (SFT -> GRPO), and 5 GRPO
#      steps of a Qwen2.5-0.5B-shaped model in bf16 (configs/grpo_qwen2_0p5b_gpu.yaml).
# One prepared command for a 15-minute device lease (issue 41), <= 7 minutes on one H100:
#   bash tests/run_gpu.sh fast [--only STAGE,...] [--dry-run] [--budget-s 420]
#   stages, in order of value, each under its own `timeout` and all within --budget-s (a stage that fails or
#   times out does not stop the next): setup (wheels, verl._C for this GPU's arch only), tests (tests/gpu +
#   tests/kernels but its CMake build), qwen05b (5 GRPO steps, 0.5B shape, bf16: s/step, phase split, peak
#   memory, update_actor tokens/s, MFU), quickstart (SFT -> 30 GRPO steps on 1 GPU: learning), bench (verl
#   bench kernels / reshard / rollout --device cuda vs their baselines), pool (a standalone rollout pool and
#   separate_async, two ranks sharing the GPU over gloo, when its compute mode lets them). Each stage writes
#   $OUT/<stage>.json (status pass/fail/timeout/skipped, wall_s, figures, targets); then $OUT/summary.json, a table
#   and $OUT/logs.tar.gz (every log: 8 files in $OUT, what the device tool brings back). Work files go to
#   $GPU_WORK (default /tmp/verl-gpu-fast). --only reruns the named stages (setup always runs first; it skips
#   what is done). --dry-run rehearses on CPU: the benches with CPU stand-ins (tiny models, --device cpu), the
#   trainers' configs and overrides checked as verl train checks them, pytest --collect-only, every stage's JSON
#   written (tests/unit/test_run_gpu_fast.py). Wheels: bash launch/fetch_gpu_wheels.sh (carry: [".whl"]).
# The older per-stage commands (each prints its wall time and fits a 10-minute limit):
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
OUT_GIVEN="${OUT:-}"
export OUT="${OUT:-$ROOT/outputs/gpu}"
mkdir -p "$OUT"
stage="${1:-all}"
t0=$SECONDS
say() { printf '[run_gpu %4ds] %s\n' "$((SECONDS - t0))" "$*"; }

need_cuda() {
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "run_gpu: expected a CUDA device visible to torch, found none" >&2; exit 2; }
}

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
# ---------------------------------------------------------------------------------------------------------------
# fast: one command for a lease
# ---------------------------------------------------------------------------------------------------------------
FAST_STAGES=(setup tests qwen05b quickstart bench pool)
# Each stage's own limit (s); all of them also share --budget-s (default 420 s = 7 minutes).
declare -A FAST_CAP=([setup]=150 [tests]=120 [qwen05b]=120 [quickstart]=120 [bench]=120 [pool]=90)
WORK="${GPU_WORK:-/tmp/verl-gpu-fast}"
DRY="${FAST_DRY:-0}"
MODEL_05B=configs/models/qwen2p5_0p5b.json
TINY=configs/models/qwen2_tiny_arith.json

fast_setup() {
  local install_s=0 build_s=0 arch t
  if [[ "$DRY" == 1 ]]; then
    # Stand-in: no build on CPU; the wheels are checked when fetched, else their list is read.
    if compgen -G ".whl/*.whl" >/dev/null; then bash launch/fetch_gpu_wheels.sh --check; else
      bash launch/fetch_gpu_wheels.sh --list >/dev/null; fi
    arch="9.0 (stand-in: no GPU here)"
  else
    t=$SECONDS
    if ! "$PY" -c "import megatron.core, omegaconf, hydra, tensordict" 2>/dev/null; then
      compgen -G ".whl/*.whl" >/dev/null \
        || { echo "run_gpu: expected wheels in .whl/ (bash launch/fetch_gpu_wheels.sh), found none" >&2; exit 2; }
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    fi
    install_s=$((SECONDS - t))
    arch="$("$PY" -m helpers.gpu_fast arch)"
    t=$SECONDS
    so="$(compgen -G "verl/_C*.so" | head -1 || true)"
    if [[ -n "$so" && -z "$(find csrc setup.py -newer "$so" -type f | head -1)" ]] \
        && "$PY" -c "import torch, verl._C as C, sys; sys.exit(0 if C.built_with_cuda() else 1)" 2>/dev/null; then
      say "verl._C with CUDA is up to date ($so)"
    else
      say "building verl._C with CUDA for this GPU only (TORCH_CUDA_ARCH_LIST=$arch)"
      TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace \
        >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
    fi
    build_s=$((SECONDS - t))
    "$PY" -c "import torch, verl._C as C; assert C.built_with_cuda(), 'verl._C has no CUDA'"
  fi
  ARCH="$arch" INSTALL_S="$install_s" BUILD_S="$build_s" "$PY" - "$WORK/setup_facts.json" <<'PYEOF'
import json, os, sys
import torch
cuda = torch.cuda.is_available()
facts = {"gpu": torch.cuda.get_device_name(0) if cuda else None,
         "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
         "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
         "arch_list": os.environ["ARCH"], "torch": torch.__version__, "cuda": torch.version.cuda,
         "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
         "install_s": int(os.environ["INSTALL_S"]), "build_s": int(os.environ["BUILD_S"])}
try:
    import verl._C as C
    facts["verl_c_cuda"] = bool(C.built_with_cuda())
except ImportError as err:
    facts["verl_c_cuda"] = None if not cuda else False
    facts["verl_c_error"] = str(err)[:200]
from importlib.metadata import PackageNotFoundError, version
for name in ("megatron-core", "omegaconf", "hydra-core", "tensordict", "transformers"):
    try:
        facts[name] = version(name)
    except PackageNotFoundError:
        facts[name] = None
json.dump(facts, open(sys.argv[1], "w"), indent=1)
PYEOF
}

fast_tests() {
  # The CMake build test (ctest + nvcc for two archs) is the CPU tiers' job; setup already built the CUDA sources.
  local args=(tests/gpu tests/kernels --ignore=tests/kernels/test_cmake_build.py -p no:cacheprovider -q -rs)
  if [[ "$DRY" == 1 ]]; then
    # The paths and options only: the CPU tiers already collect (and skip) these files.
    "$PY" -m pytest "${args[@]}" --collect-only -p no:python --noconftest || (($? == 5))  # 5: nothing collected
  else
    "$PY" -c "import pytest_timeout" 2>/dev/null && args+=(--timeout=100)
    "$PY" -m pytest "${args[@]}" --durations=10 --junitxml="$WORK/tests.xml"
  fi
}

fast_data() {  # the arithmetic task and its tokenizer, once per work directory
  [[ -f "$WORK/data/train.parquet" ]] || "$PY" -m verl.cli data arithmetic --out "$WORK/data" >/dev/null
}

fast_qwen05b() {
  fast_data
  local args=(--config configs/grpo_qwen2_0p5b_gpu.yaml "data.train_files=$WORK/data/train.parquet"
              "data.val_files=$WORK/data/test.parquet" "data.tokenizer=$WORK/data/tokenizer"
              "trainer.output_dir=$WORK/qwen05b" trainer.resume_mode=disable "trainer.logger=[console]")
  if [[ "$DRY" == 1 ]]; then
    "$PY" -m helpers.gpu_fast check-train --json "$WORK/qwen05b_check.json" -- "${args[@]}"
  else
    rm -rf "$WORK/qwen05b"
    "$PY" -m verl.cli train "${args[@]}"
  fi
}

fast_quickstart() {
  local args=(--out "$WORK/quickstart" --fresh --sft-override trainer.nproc=1 trainer.n_gpus_per_node=1
              actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 trainer.total_training_steps=30
              trainer.test_freq=10 trainer.save_freq=-1 trainer.export_hf_at_end=false)
  if [[ "$DRY" == 1 ]]; then
    "$PY" -m helpers.gpu_fast check-quickstart --json "$WORK/quickstart_check.json" -- "${args[@]}"
  else
    "$PY" -m launch.quickstart "${args[@]}"
  fi
}

fast_bench() {
  # GPU: the issue's sizes; --dry-run: the same commands and flags with CPU stand-ins (tiny sizes and models).
  local device=cuda sizes=1,16,256 cases="" model=$MODEL_05B batch=512 prompt=16 new=128 reps=3 rc=0
  if [[ "$DRY" == 1 ]]; then
    device=cpu sizes=1 cases="--cases=qkv_regroup,small_tensors_bucket" model=configs/models/qwen2_0p7m_arith.json
    batch=2 prompt=4 new=4 reps=1
  fi
  say "bench kernels --device $device"
  "$PY" -m verl.cli bench kernels --device "$device" --dtype bfloat16 --sizes-mb "$sizes" ${cases:+"$cases"} \
    --repeats "$reps" --json "$WORK/bench_kernels.json" || rc=1
  say "bench reshard --device $device ($model, tp1 -> rollout tp1, one rank)"
  "$PY" -m verl.cli bench reshard --device "$device" --model "$model" --train tp=1 --rollout tp=1 --nproc 1 \
    --dtype bfloat16 --repeats "$reps" --timeout 60 --json "$WORK/bench_reshard.json" || rc=1
  if [[ "$DRY" == 1 ]]; then model=$TINY; fi
  say "bench rollout --device $device ($model, $batch x $new, vs transformers generate)"
  "$PY" -m verl.cli bench rollout --device "$device" --model "$model" --batch "$batch" --prompt-len "$prompt" \
    --new-tokens "$new" --dtype bfloat16 --repeats "$((reps > 2 ? 2 : reps))" --skip-sglang --skip-vllm --baseline hf \
    --json "$WORK/bench_rollout.json" || rc=1
  return $rc
}

fast_pool() {
  # Two ranks on one GPU (trainer + pool) need a compute mode that lets two processes share it; NCCL refuses
  # two ranks on one device, so they talk over gloo (verl.utils.device.dist_backend).
  local mode share rc=0
  if [[ "$DRY" == 1 ]]; then mode="cpu ranks (dry run)" share=true; else
    mode="$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1 || echo unknown)"
    case "$mode" in Default|unknown) share=true ;; *) share=false ;; esac
  fi
  printf '{"compute_mode": "%s", "two_ranks_share_gpu": %s}\n' "$mode" "$share" >"$WORK/pool_facts.json"
  if [[ "$share" != true ]]; then say "compute mode $mode: two ranks cannot share the GPU; pool stage not run"; return 0; fi
  local common=(--model "$TINY" --prompts 16 --n 4 --response-length 8 --steps 4 --warmup 1)
  local standalone=("${common[@]}" --nproc 1 --workdir "$WORK/pool_standalone" --json "$WORK/pool_standalone_pool.json"
                    actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1)
  local separate=("${common[@]}" --mode separate_async --nproc 2 --rollout-ranks 1 --workdir "$WORK/pool_separate"
                  --json "$WORK/pool_separate_async.json")
  if [[ "$DRY" == 1 ]]; then
    "$PY" -m helpers.gpu_fast check-bench-train --work "$WORK" --json "$WORK/pool_standalone_pool.json" \
      --json "$WORK/pool_separate_async.json" -- "${standalone[@]}" ::: "${separate[@]}"
    return
  fi
  mkdir -p "$WORK/pool_standalone" "$WORK/pool_separate"
  say "a standalone rollout pool: 1 training rank + 1 rollout rank on the one GPU, sync, 4 steps"
  "$PY" -m verl.cli bench train "${standalone[@]}" || rc=1
  say "separate_async: 1 training rank + a 1-rank pool, 4 steps"
  "$PY" -m verl.cli bench train "${separate[@]}" || rc=1
  return $rc
}

fast() {
  local only="" budget=420 arg
  while (($#)); do
    arg="$1"; shift
    case "$arg" in
      --only) only="${1:-}"; shift || true ;;
      --only=*) only="${arg#--only=}" ;;
      --dry-run) DRY=1 ;;
      --budget-s) budget="${1:-}"; shift || true ;;
      --budget-s=*) budget="${arg#--budget-s=}" ;;
      *) echo "run_gpu fast: expected --only STAGE,..., --dry-run or --budget-s N, found '$arg'" >&2; exit 2 ;;
    esac
  done
  [[ "$budget" =~ ^[0-9]+$ ]] || { echo "run_gpu fast: --budget-s: expected seconds, found '$budget'" >&2; exit 2; }
  local selected=(setup) name known
  if [[ -n "$only" ]]; then
    for name in ${only//,/ }; do
      known=0; for s in "${FAST_STAGES[@]}"; do [[ "$s" == "$name" ]] && known=1; done
      ((known)) || { echo "run_gpu fast: --only: expected stages among ${FAST_STAGES[*]}, found '$name'" >&2; exit 2; }
    done
    for s in "${FAST_STAGES[@]:1}"; do [[ ",$only," == *",$s,"* ]] && selected+=("$s"); done
  else
    selected=("${FAST_STAGES[@]}")
  fi
  [[ "$DRY" == 1 ]] || need_cuda
  [[ -n "$OUT_GIVEN" ]] || OUT="$ROOT/outputs/gpu_fast"
  export OUT PY PYTHONPATH GPU_WORK="$WORK" FAST_DRY="$DRY" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
  mkdir -p "$OUT" "$WORK"
  rm -f "$OUT"/*.json "$OUT/logs.tar.gz"
  local deadline=$((SECONDS + budget)) left limit start rc dry=()
  [[ "$DRY" == 1 ]] && dry=(--dry-run)
  say "fast: ${selected[*]} (budget ${budget} s${dry:+, dry run on CPU}); OUT=$OUT WORK=$WORK"
  for name in "${selected[@]}"; do
    left=$((deadline - SECONDS))
    if ((left < 20)); then
      "$PY" -m helpers.gpu_fast record "$name" --rc -1 --wall-s 0 --timeout-s 0 --work "$WORK" --out "$OUT" \
        "${dry[@]}" --skipped "${left} s left of the ${budget} s budget"
      continue
    fi
    limit=${FAST_CAP[$name]}
    ((limit > left - 5)) && limit=$((left - 5))
    say "[$name] start (limit ${limit} s)"
    start=$SECONDS
    timeout -k 10 "$limit" bash "${BASH_SOURCE[0]}" _fast_stage "$name" >"$WORK/$name.log" 2>&1 && rc=0 || rc=$?
    if ((rc != 0)); then tail -15 "$WORK/$name.log" | sed "s/^/[$name] /"; fi
    "$PY" -m helpers.gpu_fast record "$name" --rc "$rc" --wall-s "$((SECONDS - start))" --timeout-s "$limit" \
      --work "$WORK" --out "$OUT" "${dry[@]}" || true
  done
  "$PY" -m helpers.gpu_fast summary --out "$OUT" --work "$WORK" --budget-s "$budget"
  (cd "$WORK" && find . -maxdepth 3 -type f -size -8M \( -name '*.log' -o -name '*.json' -o -name '*.xml' \
      -o -name 'metrics.jsonl' \) -print0 | tar -czf "$OUT/logs.tar.gz" --null -T -) || true
}

case "$stage" in
  fast) shift; fast "$@"; say "done: fast"; exit 0 ;;
  _fast_stage) "fast_$2"; exit $? ;;
  setup|tests|bench|quickstart|qwen05b|fsdp|manycore|all) need_cuda ;;
esac
case "$stage" in
  setup) setup ;;
  tests) tests ;;
  bench) bench ;;
  quickstart) quickstart ;;
  qwen05b) qwen05b ;;
  fsdp) fsdp ;;
  manycore) manycore ;;
  all) setup; tests; bench; quickstart; qwen05b; fsdp; manycore ;;
  *) echo "run_gpu: expected a stage among fast, setup, tests, bench, quickstart, qwen05b, fsdp, manycore, all; found '$stage'" >&2
     exit 2 ;;
esac
say "done: $stage"
