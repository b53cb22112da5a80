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

# System packages: compilers, CMake/Ninja for the standalone build, Open MPI for mpi4py.
need=()
for pkg in build-essential cmake ninja-build openmpi-bin libopenmpi-dev; do
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

if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

stamp=.venv/.verl-install-stamp
want="$(cat setup.py pyproject.toml requirements*.txt $(find csrc -type f | sort) | sha256sum | cut -d' ' -f1)"
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]] && .venv/bin/python -c "import torch, verl._C" 2>/dev/null; then
  log "verl-hpc already installed and built (.venv)"
  exit 0
fi

log "installing build tools and torch==2.13.0 (CPU wheel)"
"${PIP[@]}" install --upgrade pip setuptools wheel
"${PIP[@]}" install torch==2.13.0 numpy -r requirements-build.txt
log "installing verl-hpc with its dependencies and building verl._C"
"${PIP[@]}" install --no-build-isolation -e ".[cpu,test]"
.venv/bin/python -c "import torch, verl._C" || { echo "setup: verl._C failed to build (see the pip log above)" >&2; exit 1; }
echo "$want" >"$stamp"
log "done: $(.venv/bin/verl --version)"
