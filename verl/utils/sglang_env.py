"""Where SGLang lives: importable in this Python, or in the SGLang environment launch/setup_sglang.sh builds
(``.venv-sglang``, which also holds Megatron and runs ``verl train`` with ``rollout.name=sglang``)."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sglang_importable() -> bool:
    """SGLang is installed in this Python. A folder named ``sglang`` on the path (tests/sglang under pytest)
    is a namespace package, not SGLang: it has no ``__init__`` file of its own."""
    spec = importlib.util.find_spec("sglang")
    return spec is not None and spec.origin not in (None, "namespace")


def sglang_python() -> str:
    """The python of the SGLang environment: ``VERL_SGLANG_PYTHON``, default ``<repo>/.venv-sglang/bin/python``."""
    return os.environ.get("VERL_SGLANG_PYTHON", os.path.join(REPO, ".venv-sglang", "bin", "python"))
