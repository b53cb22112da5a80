"""Stand-in for ``sgl_kernel`` (sgl-kernel's CPU build is not on PyPI), installed as the top-level
package ``sgl_kernel`` into the SGLang venv by launch/setup_sglang.sh.

SGLang imports names from sgl_kernel at module load even on paths that never call them (the CPU
route with attention_backend="torch_native"). Every attribute, of the package and of any
submodule, is a function that raises when called, so a code path that truly needs a compiled
kernel fails loudly instead of computing something wrong. The one real module,
``sgl_kernel/scalar_type.py`` (pure Python), is copied next to this file from the sglang-kernel
wheel at install time.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

__version__ = "0.0.0+verl.stub"

_HERE = os.path.dirname(os.path.abspath(__file__))


class SglKernelStubError(NotImplementedError):
    """A compiled sgl_kernel op was called on the CPU route, where only a stub exists."""


def _raising(qualname: str):
    def kernel(*args, **kwargs):
        raise SglKernelStubError(
            f"{qualname} is a compiled sgl-kernel op; this SGLang install (CPU route) has only the stub "
            f"sgl_kernel, so choose engine args that avoid it (attention_backend='torch_native')"
        )

    kernel.__name__ = qualname.rsplit(".", 1)[-1]
    kernel.__qualname__ = qualname
    return kernel


def _module_getattr(module_name: str):
    def __getattr__(name):
        if name.startswith("__"):  # keep the import system's dunder probes honest
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return _raising(f"{module_name}.{name}")

    return __getattr__


__getattr__ = _module_getattr(__name__)


class _StubSubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sgl_kernel.<anything>`` that has no real file here as a raising stub module."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        rel = fullname.split(".", 1)[1].replace(".", os.sep)
        if os.path.exists(os.path.join(_HERE, rel + ".py")) or os.path.isdir(os.path.join(_HERE, rel)):
            return None  # a real module (scalar_type) is loaded normally
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _StubSubmoduleFinder())
