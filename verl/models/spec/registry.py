"""The model specs by HF ``model_type``: every module of this package but ``base`` and ``registry`` is an
architecture family exporting ``SPECS`` (a tuple of :class:`ModelSpec`), so adding one is one new file.
A family defined elsewhere (a user's or a test's module) joins with :func:`register_spec` when imported.
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
def _package_specs() -> dict[str, ModelSpec]:
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


@functools.cache
def _specs() -> dict[str, ModelSpec]:
    return dict(_package_specs())  # the package's families, then the registered ones


def register_spec(spec: ModelSpec) -> ModelSpec:
    """Serve ``spec`` for its model types from now on, in this process (a module that calls this at import
    serves every rank that imports it). A type of this package's families is refused; registering again
    replaces (a module imported twice)."""
    taken = [t for t in spec.model_types if t in _package_specs()]
    if taken:
        raise ValueError(f"model spec: expected model types no family of verl.models.spec serves, found {taken}")
    _specs().update(dict.fromkeys(spec.model_types, spec))
    return spec


def model_types() -> tuple[str, ...]:
    """Every supported HF ``model_type``."""
    return tuple(_specs())


def model_spec(model_type: str) -> ModelSpec:
    """The spec of an HF ``model_type``; an unknown one raises :class:`UnknownModelTypeError` (one line)."""
    spec = _specs().get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        raise UnknownModelTypeError(f"model_type: expected one of {model_types()}, found {model_type!r}")
    return spec
