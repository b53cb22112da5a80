"""The tree passes ruff (verl's settings) and import-linter (the layer rule of docs/architecture.md)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_passes_with_verls_settings():
    proc = _run(os.path.join(BIN, "ruff"), "check", ".")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_import_layers_hold():
    proc = _run(os.path.join(BIN, "lint-imports"), "--no-cache")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_verl_never_imports_launch():
    hits = []
    for root, _, files in os.walk(os.path.join(REPO, "verl")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name), encoding="utf-8") as fh:
                    hits += [f"{name}: {line.strip()}" for line in fh
                             if line.lstrip().startswith(("from launch", "import launch"))]
    assert not hits, hits
