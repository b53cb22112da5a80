"""launch/link_identical_files.py: the engine venvs store the files they share with .venv (torch) once."""

import os
import subprocess
import sys
import sysconfig

import pytest

pytestmark = pytest.mark.unit

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "link_identical_files.py")
SITE = os.path.relpath(sysconfig.get_paths()["purelib"], sysconfig.get_paths()["data"])


def _venv(root, files: dict[str, bytes], mode: int = 0o644) -> str:
    for rel, data in files.items():
        path = os.path.join(root, SITE, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
    return str(root)


def _run(*venvs):
    return subprocess.run([sys.executable, SCRIPT, *venvs], capture_output=True, text=True)


def _inode(venv, rel):
    return os.stat(os.path.join(venv, SITE, rel)).st_ino


def test_identical_files_become_one_inode_and_the_rest_stay_apart(tmp_path):
    base = _venv(tmp_path / "base", {"torch/lib/a.so": b"x" * 4096, "torch/b.json": b"same",
                                     "torch/c.so": b"base", "shared/d.so": b"first", "torch/m.py": b"x = 1\n",
                                     "torch/__pycache__/m.cpython-311.pyc": b"bytecode"})
    engine = _venv(tmp_path / "engine", {"shared/d.so": b"first", "triton/e.so": b"t" * 100})
    target = _venv(tmp_path / "target", {"torch/lib/a.so": b"x" * 4096, "torch/b.json": b"same",
                                         "torch/c.so": b"mine", "shared/d.so": b"first",
                                         "triton/e.so": b"t" * 100, "own/f.so": b"own", "torch/m.py": b"x = 1\n",
                                         "torch/__pycache__/m.cpython-311.pyc": b"bytecode"})
    os.symlink("b.json", os.path.join(target, SITE, "torch", "link.json"))
    result = _run(target, base, engine)
    assert result.returncode == 0, result.stderr
    assert "4 files" in result.stderr and "GiB freed" in result.stderr
    for rel in ("torch/lib/a.so", "torch/b.json", "shared/d.so"):  # the first source wins where both have it
        assert _inode(target, rel) == _inode(base, rel)
    assert _inode(target, "triton/e.so") == _inode(engine, "triton/e.so")
    assert _inode(target, "torch/c.so") != _inode(base, "torch/c.so")  # different bytes
    with open(os.path.join(target, SITE, "torch", "c.so"), "rb") as f:
        assert f.read() == b"mine"
    # a linked source would take the other venv's mtime and make its own bytecode stale at every import
    for rel in ("torch/m.py", "torch/__pycache__/m.cpython-311.pyc"):
        assert _inode(target, rel) != _inode(base, rel)
    assert os.path.islink(os.path.join(target, SITE, "torch", "link.json"))
    assert not [n for n in os.listdir(os.path.join(target, SITE, "torch")) if ".verl-link-" in n]
    # a second run finds everything shared and changes nothing
    again = _run(target, base, engine)
    assert again.returncode == 0 and "0 files" in again.stderr


def test_a_different_mode_keeps_its_own_copy(tmp_path):
    base = _venv(tmp_path / "base", {"bin/tool": b"#!/bin/sh\n"}, mode=0o755)
    target = _venv(tmp_path / "target", {"bin/tool": b"#!/bin/sh\n"}, mode=0o644)
    assert _run(target, base).returncode == 0
    assert _inode(target, "bin/tool") != _inode(base, "bin/tool")
    assert os.stat(os.path.join(base, SITE, "bin", "tool")).st_mode & 0o777 == 0o755


def test_a_missing_target_is_one_line_and_exit_2(tmp_path):
    result = _run(str(tmp_path / "nowhere"), str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "expected a venv at" in result.stderr
