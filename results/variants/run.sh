#!/usr/bin/env bash
# The quickstart's variants (README "Mixture of experts", "A standalone rollout pool", "Asynchronous training"), 3
# seeds each: the quickstart (data -> SFT warm start -> 100 GRPO steps) with the tiny Qwen3-MoE on an EP2 actor
# (configs/grpo_qwen3moe_tiny.yaml), with the rollout on a standalone pool (2 training ranks + 1 rollout rank), and
# with verl's V1 async modes (colocate_async; separate_async on the same pool layout);
# trainer.seed=N seeds the data split, the SFT stage and RL. Copies each run's metrics.jsonl and summary.json next
# to this script (logs/), then summarizes. ~4 min a run on 2 cores. VARIANTS="moe" reruns a subset.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
VARIANTS="${VARIANTS:-moe pool colocate_async separate_async}"
mkdir -p "$LOGS"
for VARIANT in $VARIANTS; do
  case "$VARIANT" in
    moe) ARGS=(--config configs/grpo_qwen3moe_tiny.yaml) ;;
    pool) ARGS=(trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1) ;;
    colocate_async) ARGS=(trainer.use_v1=true trainer.v1.trainer_mode=colocate_async) ;;
    separate_async) ARGS=(trainer.use_v1=true trainer.v1.trainer_mode=separate_async trainer.n_gpus_per_node=2
                          actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1) ;;
    *) echo "run.sh: expected VARIANTS among moe pool colocate_async separate_async, found $VARIANT" >&2; exit 2 ;;
  esac
  for N in 0 1 2; do
    OUT="outputs/qs_${VARIANT}_seed$N"
    bash launch/quickstart.sh --fresh --out "$OUT" "${ARGS[@]}" "trainer.seed=$N" > "$LOGS/${VARIANT}_seed$N.log" 2>&1
    rm -rf "$LOGS/${VARIANT}_seed$N" && mkdir -p "$LOGS/${VARIANT}_seed$N"
    cp "$OUT/metrics.jsonl" "$OUT/summary.json" "$LOGS/${VARIANT}_seed$N/"
  done
done
MACHINE=machine  # a subset's machine record beside the full run's: machine.<variant>+<variant>.txt
[[ "$VARIANTS" == "moe pool colocate_async separate_async" ]] || MACHINE="machine.${VARIANTS// /+}"
bash "$HERE/../quickstart/machine.sh" > "$LOGS/$MACHINE.txt"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
