"""A registry's names as a config rule's choices, read when a config is checked (not when the rule was made), so a
name registered after import -- by a user's module (``actor_rollout_ref.model.external_lib``) or a test -- counts.
Torch-free: the config check and the engine table use it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence


class RegistryNames(Sequence):
    """The keys of ``registry`` (a mapping that registrations add to), sorted when ``sort``, else in registration
    order."""

    def __init__(self, registry: Mapping[str, object], sort: bool = False):
        self._registry = registry
        self._sort = sort

    def _names(self) -> tuple[str, ...]:
        return tuple(sorted(self._registry)) if self._sort else tuple(self._registry)

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._registry)

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(self._names())
