#!/usr/bin/env bash
# vLLM's CPU backend serving a LoRA adapter vs generating without one (issue 55): probe.py in .venv-vllm on
# SmolLM2-135M-Instruct, an engine built without LoRA ("base") and one with LoRA enabled ("lora"), the latter timed
# with and without the adapter on the requests. ~3 min on 2 idle cores. Writes logs/ next to this script.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
{ bash "$ROOT/results/quickstart/machine.sh"; .venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"; } \
    > "$LOGS/machine.txt" 2>&1
SMOL="$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests"); from helpers.real_model import smollm2_dir; print(smollm2_dir())')"
for MODE in base lora; do
  .venv-vllm/bin/python "$HERE/probe.py" "$SMOL" "$MODE" > "$LOGS/$MODE.log" 2>&1
done
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
