"""The tree passes ruff (verl's settings) and import-linter (the layer rule of docs/architecture.md)."""

import os
import re
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


def _doc_layers() -> list[str]:
    """The first column of the table under '## Layers' in docs/architecture.md, top to bottom."""
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [" | ".join(re.findall(r"`([\w.]+)`", row.split(" | ")[0])) for row in rows]


def test_architecture_doc_lists_the_contracts_layers():
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as fh:  # no tomllib on Python 3.10
        block = re.search(r"^layers = \[(.*?)^\]", fh.read(), re.S | re.M).group(1)
    layers = re.findall(r'"([^"]+)"', block)
    assert _doc_layers() == [" | ".join(part.strip() for part in layer.split("|")) for layer in layers]


def test_markdown_files_named_in_the_code_exist():
    """Docstrings and comments may point only at documents that are in the repository."""
    docs = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("outputs", "build", "__pycache__")]
        docs += [os.path.relpath(os.path.join(root, name), REPO) for name in files if name.endswith(".md")]
    missing = []
    for top in ("verl", "launch", "tests", "csrc", "slurm", "configs"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith((".py", ".sh", ".cpp", ".cu", ".h", ".yaml", ".sbatch", ".txt")):
                    continue
                with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
                    for ref in re.findall(r"[\w./-]*\w\.md\b", fh.read()):
                        ref = ref.lstrip("/")  # the tail of a formatted path ("results/{name}/README.md")
                        if not any(doc == ref or doc.endswith("/" + ref) for doc in docs):
                            missing.append(f"{os.path.relpath(os.path.join(root, name), REPO)}: {ref}")
    assert not missing, missing


def test_test_module_names_are_unique_across_tiers():
    """pytest imports test modules by basename (rootdir-relative, no packages): two tiers with the same file name
    stop the whole suite at collection."""
    seen: dict[str, str] = {}
    clashes = []
    for root, dirs, files in os.walk(os.path.join(REPO, "tests")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                where = os.path.relpath(os.path.join(root, name), REPO)
                if name in seen:
                    clashes.append((seen[name], where))
                seen[name] = where
    assert not clashes, clashes
