"""What the tiers of engines that live in their own venv share (tests/sglang, tests/vllm): the set-up script run
once per session, and one driver subprocess in that venv that runs a batch of cases."""

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INDEX_UNREACHABLE = 3  # the set-up scripts' exit code when the package index cannot be reached


def engine_python(setup: str, venv_var: str, venv: str, what: str) -> str:
    """Run ``launch/<setup>`` (idempotent) and return its venv's python; skip the tier, with one message, only when
    the script reports the package index unreachable; any other install problem fails it."""
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", setup)], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode == INDEX_UNREACHABLE:
        pytest.skip(f"{what} tier skipped: it cannot be installed here (package index unreachable)")
    if proc.returncode != 0:
        pytest.fail(f"launch/{setup} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
    return os.path.join(os.environ.get(venv_var, os.path.join(ROOT, venv)), "bin", "python")


def session_runner(python: str, script: str, what: str, threads: int):
    """``run(cases, work_dir, timeout_s) -> results``: one ``script`` subprocess under ``python`` runs every case of
    ``cases`` (its SPEC format) and returns its OUT json."""

    def run(cases: dict, work, timeout_s: int) -> dict:
        spec, out = work / "spec.json", work / "out.json"
        spec.write_text(json.dumps({"cases": cases}))
        proc = subprocess.run([python, script, str(spec), str(out)], capture_output=True, text=True,
                              timeout=timeout_s, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), cwd=str(work))
        assert proc.returncode == 0, f"{what} session failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
        return json.loads(out.read_text())

    return run
