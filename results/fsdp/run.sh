#!/usr/bin/env bash
# The FSDP backend's figures (README "The FSDP backend"), 3 seeds each: the quickstart (data -> SFT warm start ->
# 100 RL steps) with GRPO on an FSDP2 actor (configs/grpo_arith_tiny_fsdp.yaml) and with PPO + critic on FSDP2
# (configs/ppo_arith_tiny.yaml actor_rollout_ref.actor.strategy=fsdp); trainer.seed=N seeds the data split, the SFT
# stage and RL. Copies each run's metrics.jsonl and summary.json next to this script (logs/), then summarizes.
# ~3 min a run on 2 cores.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
for N in 0 1 2; do
  bash launch/quickstart.sh --config configs/grpo_arith_tiny_fsdp.yaml --fresh --out "outputs/qs_fsdp_grpo_seed$N" \
    "trainer.seed=$N"
  bash launch/quickstart.sh --config configs/ppo_arith_tiny.yaml --fresh --out "outputs/qs_fsdp_ppo_seed$N" \
    actor_rollout_ref.actor.strategy=fsdp "trainer.seed=$N"
  for algo in grpo ppo; do
    mkdir -p "$LOGS/${algo}_seed$N"
    cp "outputs/qs_fsdp_${algo}_seed$N/metrics.jsonl" "outputs/qs_fsdp_${algo}_seed$N/summary.json" \
      "$LOGS/${algo}_seed$N/"
  done
done
bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.txt"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
