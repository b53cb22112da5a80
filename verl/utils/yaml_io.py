"""YAML as verl users write it: ``yaml.safe_load`` with YAML 1.2's float syntax.

PyYAML implements YAML 1.1, where ``1e-4`` (no dot) and ``5e-7`` are strings; verl's docs and
examples write learning rates exactly so (``actor.optim.lr=1e-6``), and OmegaConf/Hydra read them
as floats. This loader adds YAML 1.2's float forms (``1e-4``, ``1E3``, ``.5``, ``1.``, ``1_000.5``)
and nothing else: every other tag resolves as in ``yaml.SafeLoader``.
"""

from __future__ import annotations

import re
from typing import IO, Any

import yaml

_FLOAT_12 = re.compile(r"""^(?:
    [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?   # 1.5, 1., 1.5e-3
   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)             # 1e-4, 5E7 (YAML 1.2, not 1.1)
   |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?                   # .5, .5e-2
   |[-+]?\.(?:inf|Inf|INF)
   |\.(?:nan|NaN|NAN)
)$""", re.X)


class SafeLoader12(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose floats follow YAML 1.2."""


SafeLoader12.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _first, _resolvers in SafeLoader12.yaml_implicit_resolvers.items():
    _resolvers[:] = [(tag, regexp) for tag, regexp in _resolvers if tag != "tag:yaml.org,2002:float"]
SafeLoader12.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def safe_load(stream: str | bytes | IO[Any]) -> Any:
    """``yaml.safe_load`` with YAML 1.2 floats (see the module docstring)."""
    return yaml.load(stream, Loader=SafeLoader12)  # noqa: S506 - a SafeLoader subclass


def read_yaml_file(path: str, what: str) -> Any:
    """The YAML file ``path`` (:func:`safe_load`), or one :class:`~verl.errors.InputError` line naming ``what`` (the
    key that pointed at it) and the cause: the file unreadable, or not YAML (with the line where it broke)."""
    from verl.errors import InputError

    try:
        with open(path, encoding="utf-8") as fh:
            return safe_load(fh)
    except OSError as e:
        raise InputError(f"{what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise InputError(f"{what} {path}: expected YAML, found bytes that are not UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise InputError(f"{what} {path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
