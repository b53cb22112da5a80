"""Reward-model hot swap between steps (``reward_model.hot_swap``, see :mod:`verl.trainer.ppo.trainer`): a watched
``reward_model.model.path`` that changed, or ``hot_swap.path`` at ``hot_swap.at_step``, reloaded on every rank."""

from __future__ import annotations

from typing import Any

from verl.single_controller import broadcast_object


class RewardModelSwap:
    """The PPO trainer's reward-model swap (reads ``sections``, ``rank``, ``rm_wg``; keeps ``rm_path`` and the
    watched path's fingerprint)."""

    def _watched_rm_fingerprint(self) -> Any:
        """Rank 0's view of ``reward_model.model.path``, the same on every rank (None when not watched)."""
        from verl.workers.reward_model_worker import checkpoint_fingerprint

        if not self.sections.reward_model.hot_swap.watch:
            return None
        local = checkpoint_fingerprint(self.sections.reward_model.model.path) if self.rank == 0 else None
        return broadcast_object(local)

    def swap_reward_model(self, path: str) -> None:
        with self._timer("swap_reward_model"):
            self.rm_wg.swap_reward_model(path)
        self.rm_path = path
        self._print(f"[reward_model] swapped to {path}")

    def _maybe_swap_reward_model(self, step: int) -> dict[str, float]:
        swap = self.sections.reward_model.hot_swap
        path = None
        if swap.at_step is not None and step == swap.at_step:
            path = swap.path
        fingerprint = self._watched_rm_fingerprint()
        if fingerprint != self._rm_fingerprint:
            path = self.sections.reward_model.model.path
            self._rm_fingerprint = fingerprint
        if path is not None:
            self.swap_reward_model(path)
        return {"reward_model/swapped": float(path is not None)}
