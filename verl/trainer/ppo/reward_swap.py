"""Reward-model hot swap between steps (``reward_model.hot_swap``, see :mod:`verl.trainer.ppo.trainer`): a watched
``reward_model.model.path`` that changed, or ``hot_swap.path`` at ``hot_swap.at_step``, reloaded on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl.single_controller import broadcast_object
from verl.trainer.ppo.context import PhaseTimer, Roles


class RewardModelSwap:
    """The reward model in use (``path``) and its swap, on every rank (collective: rank 0 reads the watched path and
    tells the others). Built with the sections, the roles (whose ``rm_wg`` reloads), the timer and the console."""

    def __init__(self, sections: Any, roles: Roles, timer: PhaseTimer, *, rank: int, say: Callable[[str], None]):
        self.sections, self.roles, self.timer, self.rank, self.say = sections, roles, timer, rank, say
        self.path = sections.reward_model.model.path
        self._fingerprint = self._watched_fingerprint()

    def _watched_fingerprint(self) -> Any:
        """Rank 0's view of ``reward_model.model.path``, the same on every rank (None when not watched)."""
        from verl.workers.reward_model_worker import checkpoint_fingerprint

        if not self.sections.reward_model.hot_swap.watch:
            return None
        local = checkpoint_fingerprint(self.sections.reward_model.model.path) if self.rank == 0 else None
        return broadcast_object(local)

    def swap(self, path: str) -> None:
        """Load ``path`` as the reward model on every rank."""
        with self.timer("swap_reward_model"):
            self.roles.rm_wg.swap_reward_model(path)
        self.path = path
        self.say(f"[reward_model] swapped to {path}")

    def maybe_swap(self, step: int) -> dict[str, float]:
        """Before step ``step``'s rewards: the scheduled swap at its step, or the watched path's new contents;
        returns ``reward_model/swapped``."""
        swap = self.sections.reward_model.hot_swap
        path = None
        if swap.at_step is not None and step == swap.at_step:
            path = swap.path
        fingerprint = self._watched_fingerprint()
        if fingerprint != self._fingerprint:
            path = self.sections.reward_model.model.path
            self._fingerprint = fingerprint
        if path is not None:
            self.swap(path)
        return {"reward_model/swapped": float(path is not None)}
