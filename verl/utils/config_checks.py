"""One leaf of a YAML config checked: its type, choices and range, one line naming the dotted key on failure.

The trainer's loader (:mod:`verl.trainer.config.loader`) checks every leaf of a composed config with it, and
the typed config sections (:mod:`verl.workers.config`) check their fields with it: one rule language, one
message format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from verl.errors import InputError


class ConfigError(InputError):
    """A config that cannot run; the message is one line naming the key."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a key's default cannot say: the types a value may have (default: the default's type),
    whether null is allowed (default: when the default is null), its choices and numeric range."""

    types: tuple[type, ...] = ()
    nullable: bool | None = None
    choices: tuple[Any, ...] | None = None
    ge: float | None = None  # value >= ge, value > gt, value <= le
    gt: float | None = None
    le: float | None = None

    def range_text(self) -> str:
        bounds = ((">=", self.ge), (">", self.gt), ("<=", self.le))
        return " and ".join(f"{op} {bound:g}" for op, bound in bounds if bound is not None)

    def in_range(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))


def rule(*types: type, nullable: bool | None = None, choices: Sequence[Any] | None = None,
         ge: float | None = None, gt: float | None = None, le: float | None = None) -> Rule:
    if choices is not None and (isinstance(choices, list) or not isinstance(choices, Sequence)):
        choices = tuple(choices)  # frozen; a Sequence view (a registry's live names) is kept as is
    return Rule(tuple(types), nullable, choices, ge, gt, le)


def _type_names(types: tuple[type, ...], nullable: bool) -> str:
    names = [t.__name__ for t in types if not (t is int and float in types)]
    names = ["list" if n == "list" else n for n in names]
    return " or ".join(names + (["null"] if nullable else []))


def check_value(dotted: str, value: Any, default: Any, rule_: Rule | None) -> Any:
    """``value`` checked against its default's type and its rule; returns it normalised (int<->float)."""
    rule_ = rule_ or Rule()
    types = rule_.types or ((type(default),) if default is not None else ())
    if float in types and int not in types:
        types = types + (int,)
    nullable = rule_.nullable if rule_.nullable is not None else default is None
    if value is None:
        if not nullable:
            raise ConfigError(f"{dotted}: expected {_type_names(types, False)}, found null")
        return None
    if types:
        if int in types and float not in types and isinstance(value, float) and value.is_integer():
            value = int(value)  # `trainer.total_training_steps=1e3` (a float) is the integer 1000
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            raise ConfigError(f"{dotted}: expected {_type_names(types, nullable)}, found "
                              f"{type(value).__name__} {value!r}")
        if float in types and isinstance(value, int) and not isinstance(value, bool) and int not in rule_.types:
            value = float(value)
    if rule_.choices is not None and value not in rule_.choices:
        raise ConfigError(f"{dotted}: expected one of {list(rule_.choices)}, found {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value != value:  # NaN passes no range and poisons every step
            raise ConfigError(f"{dotted}: expected a number, found nan")
        if not rule_.in_range(value):
            raise ConfigError(f"{dotted}: expected a value {rule_.range_text()}, found {value!r}")
    return value
