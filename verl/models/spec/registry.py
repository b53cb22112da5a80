"""The model specs by HF ``model_type``: every module of this package but ``base`` and ``registry`` is an
architecture family exporting ``SPECS`` (a tuple of :class:`ModelSpec`), so adding one is one new file.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

import verl.models.spec as _package
from verl.errors import InputError
from verl.models.spec.base import ModelSpec

_NOT_FAMILIES = ("base", "registry")


class UnknownModelTypeError(InputError):
    """An HF ``model_type`` no spec serves."""


@functools.cache
def _specs() -> dict[str, ModelSpec]:
    out: dict[str, ModelSpec] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(_package.__path__)):
        if module in _NOT_FAMILIES:
            continue
        for spec in importlib.import_module(f"{_package.__name__}.{module}").SPECS:
            for model_type in spec.model_types:
                if model_type in out:
                    raise ValueError(f"model spec: expected one spec per model_type, found two for {model_type!r}")
                out[model_type] = spec
    return out


def model_types() -> tuple[str, ...]:
    """Every supported HF ``model_type``."""
    return tuple(_specs())


def model_spec(model_type: str) -> ModelSpec:
    """The spec of an HF ``model_type``; an unknown one raises :class:`UnknownModelTypeError` (one line)."""
    try:
        return _specs()[model_type]
    except KeyError:
        raise UnknownModelTypeError(f"model_type: expected one of {model_types()}, found {model_type!r}") from None
