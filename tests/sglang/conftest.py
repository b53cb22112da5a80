"""SGLang tier fixtures: SGLang lives in its own venv (.venv-sglang), driven through subprocesses.

The session fixture runs launch/setup_sglang.sh first (idempotent: a stamp check when
already installed). The tier skips, with one message, only when that script reports the package
index unreachable (exit 3); any other install problem fails the tier.
"""

import os

import pytest
from helpers.engine_tiers import engine_python, session_runner

HERE = os.path.dirname(os.path.abspath(__file__))
SESSION_SCRIPT = os.path.join(HERE, "sglang_session.py")


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """Path of the python that has SGLang 0.5.23 (CPU route) and this project installed."""
    return engine_python("setup_sglang.sh", "VERL_SGLANG_VENV", ".venv-sglang", "SGLang 0.5.23")


@pytest.fixture(scope="session")
def run_sglang_session(sglang_python):
    """``run(cases, work_dir, timeout_s) -> results``: one sglang_session.py subprocess in .venv-sglang
    runs every case of ``cases`` (its SPEC format) and returns its OUT json."""
    return session_runner(sglang_python, SESSION_SCRIPT, "SGLang", threads=1)
