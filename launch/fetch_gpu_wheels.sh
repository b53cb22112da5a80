#!/usr/bin/env bash
# The Python packages verl-hpc needs that the bare GPU image lacks (its image has CUDA torch 2.11, transformers,
# pyarrow, mpi4py, peft, accelerate, cloudpickle, ...), as wheels for its
# Python 3.12 in .whl/, which the device tool carries (`carry: [".whl"]`) and tests/run_gpu.sh installs with
# `pip install --no-index --no-deps --target /tmp/verl-site .whl/*.whl`. Run it on a machine with network:
#   bash launch/fetch_gpu_wheels.sh           # download what is missing from .whl/, then check it
#   bash launch/fetch_gpu_wheels.sh --list    # print the pinned list (name==version expected_bytes), fetch nothing
#   bash launch/fetch_gpu_wheels.sh --check   # check .whl/ holds exactly one wheel of each, under the carry limit
# The versions are the dev venv's (requirements.txt), so the GPU runs what the CPU tiers tested.
# tests/unit/test_run_gpu_fast.py reads the list below (and checks .whl/ against it when wheels are present).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DEST="${WHEEL_DIR:-.whl}"
# name==version  wheel size in bytes as fetched 2026-11-27 (the carry budget counts them; the unit test checks them)
WHEELS=(
  "megatron-core==0.16.1 2612103"
  "omegaconf==2.3.1 79502"
  "hydra-core==1.3.8 168949"
  "antlr4-python3-runtime==4.9.3 144590"
  "tensordict==0.15.3 852373"
  "pyvers==0.2.3 11757"
)
# The device tool carries at most 64 MiB in all (working tree included); the wheels may use at most this much.
WHEEL_BUDGET_BYTES=$((16 * 1024 * 1024))

list() { printf '%s\n' "${WHEELS[@]}"; }

wheel_file() {  # the wheel of a name in $DEST (pip normalises - to _), or nothing
  local f
  for f in "$DEST"/"${1//-/_}"-*.whl; do
    [[ -f "$f" ]] && { echo "$f"; return 0; }
  done
  return 0
}

check() {
  local total=0 missing=() entry name file
  for entry in "${WHEELS[@]}"; do
    name="${entry%%==*}"
    file="$(wheel_file "$name")"
    if [[ -z "$file" ]]; then missing+=("$name"); continue; fi
    total=$((total + $(stat -c %s "$file")))
  done
  if ((${#missing[@]})); then
    echo "fetch_gpu_wheels: expected a wheel of each of ${#WHEELS[@]} packages in $DEST, found none for: ${missing[*]}" >&2
    return 2
  fi
  local count
  count=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
  if ((count != ${#WHEELS[@]})); then
    echo "fetch_gpu_wheels: expected ${#WHEELS[@]} wheels in $DEST (one per package), found $count" >&2
    return 2
  fi
  if ((total > WHEEL_BUDGET_BYTES)); then
    echo "fetch_gpu_wheels: expected the wheels under $WHEEL_BUDGET_BYTES bytes, found $total" >&2
    return 2
  fi
  echo "fetch_gpu_wheels: $count wheels in $DEST, $total bytes"
}

fetch() {
  mkdir -p "$DEST"
  local entry spec name
  for entry in "${WHEELS[@]}"; do
    spec="${entry%% *}"
    name="${spec%%==*}"
    [[ -n "$(wheel_file "$name")" ]] && continue
    if [[ "$name" == antlr4-python3-runtime ]]; then
      # Only an sdist on PyPI: build the (pure Python) wheel here.
      "$PY" -m pip wheel -q --no-deps -w "$DEST" "$spec"
    else
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$DEST" "$spec"
    fi
  done
  check
}

case "${1:-fetch}" in
  fetch) fetch ;;
  --list) list ;;
  --check) check ;;
  *) echo "fetch_gpu_wheels: expected no argument, --list or --check, found '$1'" >&2; exit 2 ;;
esac
