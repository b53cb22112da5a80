"""Worker: the base of every role (actor/rollout/ref, critic, reward) that a worker group drives."""

from __future__ import annotations

from verl.single_controller.decorator import MeshRank


class Worker:
    """A role's state on one rank. Methods decorated with ``@register`` are what the driver calls.

    A worker that splits data over its own process groups declares where this rank sits in each
    such mesh: ``dispatch_meshes()`` -> ``{"megatron": MeshRank(dp_rank, dp_size, is_collect), ...}``.
    The worker group adds the ``"dp"`` mesh (every pool rank its own replica) itself.
    """

    def dispatch_meshes(self) -> dict[str, MeshRank]:
        return {}
