#!/usr/bin/env bash
# The cross-pool weight sync against the peers' bucketed, pipelined broadcast (issue 57 item 5; docs/rollout_pool.md
# "Measured"): `verl bench reshard --placement separate` on 4 gloo ranks (2 training, 2 rollout), bf16, best of 5,
# every sync and both baselines verified bit for bit. Baselines in the same run: "bucketed" (full tensors gathered on
# training rank 0 into 4 MiB buckets, each broadcast asynchronously while the next is gathered: verl's checkpoint
# engine's and slime's shape, the same bucket size as ours) and "unbucketed" (one blocking broadcast a tensor).
# Each row twice. ~12 min on 2 cores (the 1.17B rows ~2 min each). ROWS="qwen2p5_0p5b" reruns a subset.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
mkdir -p "$LOGS"
for MODEL in ${ROWS:-qwen2p5_0p5b qwen2_1b}; do
  for LAYOUT in "tp=2,pp=1,dp=1:1:2" "fsdp=2:2:1"; do
    IFS=: read -r TRAIN TG REPLICAS <<< "$LAYOUT"
    for RUN in 1 2; do
      NAME="${MODEL}_${TRAIN//[,=]/}_tp${TG}x${REPLICAS}_run$RUN"
      OMP_NUM_THREADS=1 .venv/bin/verl bench reshard --model "configs/models/$MODEL.json" --train "$TRAIN" \
        --rollout "tp=$TG" --rollout-replicas "$REPLICAS" --placement separate --nproc 4 --dtype bfloat16 \
        --repeats 5 --json "$LOGS/$NAME.json" > "$LOGS/$NAME.log" 2>&1
      echo "$NAME: load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$LOGS/load.txt"
    done
  done
done
bash "$HERE/../quickstart/machine.sh" > "$LOGS/machine.txt"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
