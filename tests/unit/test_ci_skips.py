"""On CI (CI=true) a skipped test fails, except in the GPU tier: a tier must not pass by skipping there."""

import os
import shutil
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SKIPPING = """import pytest

def test_skips_at_run_time():
    pytest.skip("package index unreachable")
"""


def _run(tmp_path, ci: str | None):
    root = tmp_path / "tests"
    for tier in ("unit", "gpu"):
        (root / tier).mkdir(parents=True, exist_ok=True)
        (root / tier / f"test_{tier}_skip.py").write_text(SKIPPING)
    shutil.copy(os.path.join(TESTS, "conftest.py"), root / "conftest.py")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", str(root)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_outside_the_gpu_tier_fails_on_ci(tmp_path):
    proc = _run(tmp_path, "true")
    assert proc.returncode == 1, proc.stdout
    assert "FAILED tests/unit/test_unit_skip.py::test_skips_at_run_time" in proc.stdout
    assert "only the GPU tier may skip: Skipped: package index unreachable" in proc.stdout
    assert "SKIPPED [1] tests/gpu/test_gpu_skip.py" in proc.stdout


def test_a_skip_is_a_skip_off_ci(tmp_path):
    proc = _run(tmp_path, None)
    assert proc.returncode == 0, proc.stdout
    assert "2 skipped" in proc.stdout
