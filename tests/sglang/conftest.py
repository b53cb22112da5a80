"""SGLang tier fixtures: SGLang lives in its own venv (.venv-sglang), driven through subprocesses.

The session fixture runs launch/setup_sglang.sh first (idempotent: a stamp check when
already installed). The tier skips, with one message, only when that script reports the package
index unreachable (exit 3); any other install problem fails the tier.
"""

import json
import os
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
INSTALL_SCRIPT = os.path.join(ROOT, "launch", "setup_sglang.sh")
SESSION_SCRIPT = os.path.join(HERE, "sglang_session.py")
INDEX_UNREACHABLE = 3


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """Path of the python that has SGLang 0.5.23 (CPU route) and this project installed."""
    venv = os.environ.get("VERL_SGLANG_VENV", os.path.join(ROOT, ".venv-sglang"))
    proc = subprocess.run(["bash", INSTALL_SCRIPT], capture_output=True, text=True, timeout=1800)
    if proc.returncode == INDEX_UNREACHABLE:
        pytest.skip("SGLang tier skipped: SGLang 0.5.23 cannot be installed here (package index unreachable)")
    if proc.returncode != 0:
        pytest.fail(f"launch/setup_sglang.sh failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}",
                    pytrace=False)
    return os.path.join(venv, "bin", "python")


@pytest.fixture(scope="session")
def run_sglang_session(sglang_python):
    """``run(cases, work_dir, timeout_s) -> results``: one sglang_session.py subprocess in .venv-sglang
    runs every case of ``cases`` (its SPEC format) and returns its OUT json."""

    def run(cases: dict, work, timeout_s: int) -> dict:
        spec, out = work / "spec.json", work / "out.json"
        spec.write_text(json.dumps({"cases": cases}))
        proc = subprocess.run([sglang_python, SESSION_SCRIPT, str(spec), str(out)], capture_output=True, text=True,
                              timeout=timeout_s, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=str(work))
        assert proc.returncode == 0, f"SGLang session failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
        return json.loads(out.read_text())

    return run
