"""The base of the typed config sections: a frozen dataclass over one section of verl's YAML.

A section's fields are the section's keys, each with its type (``int | None`` where the YAML default is null)
and, in the field's metadata, the :class:`~verl.utils.config_checks.Rule` a type cannot say (choices, range).
Defaults live in the YAML only: a section is built from a composed config (:meth:`Section.from_tree`), so no
field has a default. ``__post_init__`` checks every field with its rule; a problem is one
:class:`~verl.utils.config_checks.ConfigError` line naming the dotted key. The trainer's loader checks the
composed config's leaves with the same rules (:meth:`Section.rules`) before any rank starts.

Like verl's ``BaseConfig``, a section is also a read-only mapping (``section["key"]``, ``section.get(key)``),
so code written against verl's ``DictConfig`` sections reads it unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from verl.utils.config_checks import ConfigError, Rule, check_value


def dotted(key: str, name: str) -> str:
    """``name`` under the section at dotted ``key`` ("" for the config's root)."""
    return f"{key}.{name}" if key else name


def checked(**bounds: Any) -> Any:
    """A field's rule beyond its type: ``choices=...``, ``ge=``, ``gt=``, ``le=`` (as
    :func:`~verl.utils.config_checks.rule`)."""
    choices = bounds.get("choices")
    if choices is not None and (isinstance(choices, list) or not isinstance(choices, Sequence)):
        bounds["choices"] = tuple(choices)  # frozen; a Sequence view (a registry's live names) is kept as is
    return dataclasses.field(metadata={"rule": bounds})


@dataclasses.dataclass(frozen=True)
class Nested:
    """A field whose value is a section of its own."""

    type: type


@dataclasses.dataclass(frozen=True)
class OpenMapping:
    """A field typed ``Mapping[str, Any]``: a mapping that takes any keys (verl's ``override_*``,
    ``engine_kwargs``), with the rules of the keys this stack reads itself (field metadata ``keys``: key -> Rule)."""

    rules: dict[str, Rule]
    type: type = Mapping


@dataclasses.dataclass(frozen=True)
class Section(Mapping):
    """One YAML section; ``key`` (not a field) is its dotted key ("" for the root), which every message names."""

    key: dataclasses.InitVar[str]

    def __post_init__(self, key: str) -> None:
        object.__setattr__(self, "_key", key)
        for name, kind in self._kinds().items():
            value, where = getattr(self, name), dotted(key, name)
            if isinstance(kind, Rule):
                object.__setattr__(self, name, check_value(where, value, None, kind))
                continue
            if not isinstance(value, kind.type):
                raise ConfigError(f"{where}: expected a mapping, found {type(value).__name__} {value!r}")
            if isinstance(kind, OpenMapping):
                for inner, inner_rule in kind.rules.items():
                    if inner in value:
                        value[inner] = check_value(f"{where}.{inner}", value[inner], None, inner_rule)

    @classmethod
    @functools.cache
    def _kinds(cls) -> dict[str, Any]:
        """Each field -> its nested section (:class:`Nested`), :class:`OpenMapping`, or the Rule its type and
        metadata make."""
        hints = typing.get_type_hints(cls)
        out: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            hint = hints[field.name]
            if isinstance(hint, type) and issubclass(hint, Section):
                out[field.name] = Nested(hint)
                continue
            args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            kinds = tuple(typing.get_origin(a) or a for a in args if a is not type(None))
            if kinds == (Mapping,):
                out[field.name] = OpenMapping(dict(field.metadata.get("keys", {})))
                continue
            out[field.name] = Rule(kinds, type(None) in args, **field.metadata.get("rule", {}))
        return out

    @classmethod
    def rules(cls, key: str) -> dict[str, Rule]:
        """Every leaf's rule by dotted key under ``key`` (what the loader checks the composed config with)."""
        out: dict[str, Rule] = {}
        for name, kind in cls._kinds().items():
            if isinstance(kind, Rule):
                out[dotted(key, name)] = kind
            elif isinstance(kind, OpenMapping):
                out.update({f"{dotted(key, name)}.{inner}": inner_rule for inner, inner_rule in kind.rules.items()})
            else:
                out.update(kind.type.rules(dotted(key, name)))
        return out

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any], key: str):
        """The section at dotted ``key`` of a composed config, ``tree`` being that section's mapping."""
        if not isinstance(tree, Mapping):
            raise ConfigError(f"{key or 'config'}: expected a mapping, found {type(tree).__name__} {tree!r}")
        values = {}
        for name, kind in cls._kinds().items():
            if name not in tree:
                raise ConfigError(f"{dotted(key, name)}: expected a value, found none")
            value = tree[name]
            if isinstance(kind, Nested):
                value = kind.type.from_tree(value, dotted(key, name))
            elif isinstance(kind, OpenMapping) and isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, Sequence) and not isinstance(value, str):  # a list, or OmegaConf's ListConfig
                value = list(value)
            values[name] = value
        return cls(**values, key=key)

    # ------------------------------------------------------------------ read-only mapping (verl's BaseConfig)
    def __getitem__(self, name: str) -> Any:
        if name not in self._kinds():
            raise KeyError(dotted(self._key, name))
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds())

    def __len__(self) -> int:
        return len(self._kinds())
