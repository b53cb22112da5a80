#!/usr/bin/env bash
# The SGLang environment: one venv (.venv-sglang) holding SGLang 0.5.23 (CPU route) *and* everything
# `verl train` needs (megatron-core, verl-hpc's requirements), so a run with
# actor_rollout_ref.rollout.name=sglang has Megatron and SGLang in the same processes. Idempotent.
#   torch==2.13.0 (local CPU wheel) + sglang's non-CUDA requirements + `sglang --no-deps`,
#   a stub sgl_kernel (+ scalar_type.py from the sglang-kernel wheel), a torchvision op shim as
#   sitecustomize, verl-hpc's own requirements (megatron-core, ...; torch and SGLang's pins held),
#   this checkout on the path (.pth) and a `verl` command in .venv-sglang/bin.
# Needs launch/setup_env.sh first (it builds verl._C in the checkout for the same Python and torch).
#   bash launch/setup_sglang.sh && .venv-sglang/bin/verl train ... actor_rollout_ref.rollout.name=sglang
# Exit codes: 0 installed, 3 the package index is unreachable (callers skip), other = failure.
# Env: VERL_SGLANG_VENV (default <repo>/.venv-sglang), PYTHON (default python3.11).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VERL_SGLANG_VENV:-$ROOT/.venv-sglang}"
PY="${PYTHON:-python3.11}"
SGLANG_VERSION=0.5.23
SGLANG_KERNEL_VERSION=0.4.10  # the sglang-kernel that sglang 0.5.23 pins
REQS="$ROOT/launch/requirements-sglang-cpu.txt"
CPU_DIR="$ROOT/verl/engine/rollout/sglang_cpu"
STAMP="$VENV/.verl-sglang-cpu.stamp"
# shellcheck source=launch/engine_venv.sh
source "$ROOT/launch/engine_venv.sh"

# One install at a time: tests/run_all.sh starts this in the background for the full suite, and the sglang
# tier's fixture runs it again, waiting here until the first one is done (then the stamp makes it quick).
exec 9>"$VENV.lock"
flock 9

# The stamp records what was installed; any change to these inputs reinstalls the changed parts.
want_stamp="$(cat "$0" "$ROOT/launch/engine_venv.sh" "$REQS" "$ROOT/requirements.txt" "$CPU_DIR/sgl_kernel_stub/__init__.py" "$CPU_DIR/torchvision_op_shim.py" | sha256sum | cut -d' ' -f1) $ROOT"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

start=$(date +%s)
tmp="$(mktemp -d)"  # downloads: removed on any exit
trap 'rm -rf "$tmp"' EXIT
if ! "$PY" -m pip index versions sglang >/dev/null 2>&1 \
        && ! "$PY" -m pip download --no-deps -q -d "$tmp/probe" "sglang==$SGLANG_VERSION" >/dev/null 2>&1; then
    echo "setup_sglang: the package index is unreachable (cannot fetch sglang==$SGLANG_VERSION)" >&2
    exit 3
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" -r "$REQS"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
install_verl_beside_engine "$VENV" setup_sglang
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$SITE/sgl_kernel"
mkdir -p "$SITE/sgl_kernel"
cp "$CPU_DIR/sgl_kernel_stub/__init__.py" "$SITE/sgl_kernel/__init__.py"
# scalar_type.py is pure Python that SGLang imports for real: take it from the wheel, not from git.
"$VENV/bin/python" -m pip download -q --no-deps -d "$tmp" "sglang-kernel==$SGLANG_KERNEL_VERSION"
"$VENV/bin/python" - "$tmp" "$SITE/sgl_kernel/scalar_type.py" <<'PYEOF'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/sglang_kernel-*.whl")
if len(wheel) != 1:
    sys.exit(f"expected one sglang-kernel wheel in {sys.argv[1]}, found {wheel}")
with zipfile.ZipFile(wheel[0]) as zf:
    with open(sys.argv[2], "wb") as out:
        out.write(zf.read("sgl_kernel/scalar_type.py"))
PYEOF
cp "$CPU_DIR/torchvision_op_shim.py" "$SITE/sitecustomize.py"

# Prove the install: SGLang's engine and our loader import in a fresh process.
"$VENV/bin/python" -c "import sglang, torchvision, megatron.core, verl._C; from sglang.srt.entrypoints.engine import Engine; import verl.engine.rollout.sglang_loader"
share_identical_files "$VENV" "${VERL_VLLM_VENV:-$ROOT/.venv-vllm}"
echo "$want_stamp" > "$STAMP"
echo "setup_sglang: installed sglang==$SGLANG_VERSION (CPU route) and verl-hpc with megatron-core into $VENV in $(( $(date +%s) - start )) s" >&2
