"""SGLang tier fixtures: SGLang lives in its own venv (.venv-sglang), driven through subprocesses.

The session fixture runs tests/sglang/install_sglang_cpu.sh first (idempotent: a stamp check when
already installed). The tier skips, with one message, only when that script reports the package
index unreachable (exit 3); any other install problem fails the tier.
"""

import os
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
INSTALL_SCRIPT = os.path.join(HERE, "install_sglang_cpu.sh")
INDEX_UNREACHABLE = 3


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """Path of the python that has SGLang 0.5.23 (CPU route) and this project installed."""
    venv = os.environ.get("VERL_SGLANG_VENV", os.path.join(ROOT, ".venv-sglang"))
    proc = subprocess.run(["bash", INSTALL_SCRIPT], capture_output=True, text=True, timeout=1800)
    if proc.returncode == INDEX_UNREACHABLE:
        pytest.skip("SGLang tier skipped: SGLang 0.5.23 cannot be installed here (package index unreachable)")
    if proc.returncode != 0:
        pytest.fail(f"tests/sglang/install_sglang_cpu.sh failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}",
                    pytrace=False)
    return os.path.join(venv, "bin", "python")
