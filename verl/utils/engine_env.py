"""Where a rollout engine that pins its own packages lives: importable in this Python, or in the environment its set-up
script builds (SGLang: ``.venv-sglang``, vLLM: ``.venv-vllm``; each also holds Megatron and runs ``verl train``).
The registry names an engine's environment (``RolloutCapabilities.python_env``); everything that must start or
refuse such an engine asks here by that name."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class EngineEnv:
    name: str         # as messages name it
    package: str      # the module that must import
    venv: str         # its environment, relative to the checkout
    setup: str        # the script that builds it
    python_var: str   # the variable naming another python for it

    @property
    def python(self) -> str:
        """The environment's python: ``$<python_var>``, default ``<repo>/<venv>/bin/python``."""
        return os.environ.get(self.python_var, os.path.join(REPO, self.venv, "bin", "python"))


ENGINE_ENVS = {
    "sglang": EngineEnv("SGLang", "sglang", ".venv-sglang", "launch/setup_sglang.sh", "VERL_SGLANG_PYTHON"),
    "vllm": EngineEnv("vLLM", "vllm", ".venv-vllm", "launch/setup_vllm.sh", "VERL_VLLM_PYTHON"),
}


def importable(package: str) -> bool:
    """``package`` is installed in this Python. A folder of that name on the path (tests/sglang under pytest) is a
    namespace package, not the engine: it has no ``__init__`` file of its own."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin not in (None, "namespace")


def sglang_importable() -> bool:
    return importable("sglang")


def sglang_python() -> str:
    return ENGINE_ENVS["sglang"].python
