"""The PPO trainer's checkpoints and HF export: models, the trainer state (KL controller, reward model in use)
and what the batch source keeps (the sampler's consumed position; an asynchronous run's replay buffer), pruned
to ``trainer.max_*_ckpt_to_keep``; resume per ``trainer.resume_mode``; ``<output_dir>/actor_hf`` after a save
(``export_hf_every_save``) or at the end (``export_hf_at_end``)."""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable
from typing import Any

from verl.trainer.ppo.context import PhaseTimer, Roles
from verl.trainer.ppo.reward_swap import RewardModelSwap
from verl.utils import checkpoint as ckpt


class Checkpointing:
    """Save, resume and export of a PPO run, every method collective. Built with what a checkpoint holds: the
    roles' models, the KL controller, the batch source's state and the reward model in use (``reward_swap``); the
    step and its metrics come as arguments."""

    def __init__(self, sections: Any, roles: Roles, timer: PhaseTimer, kl_ctrl: Any, source: Any, *, rank: int,
                 say: Callable[[str], None], total_training_steps: int, reward_swap: RewardModelSwap | None = None):
        self.sections, self.roles, self.timer, self.kl_ctrl, self.source = sections, roles, timer, kl_ctrl, source
        self.rank, self.say, self.total_training_steps = rank, say, total_training_steps
        self.reward_swap = reward_swap

    def export_hf(self, step: int) -> None:
        """The actor as an HF directory, ``<output_dir>/actor_hf``."""
        path = os.path.join(self.sections.trainer.output_dir, "actor_hf")
        with self.timer("export_hf"):
            self.roles.actor_rollout_wg.export_hf(path)
        self.say(f"HF export: step {step} -> {path}")

    def _trainer_state(self, step_metrics: dict[str, Any] | None) -> dict[str, Any]:
        source = self.source.state_dict()
        state = {"sampler": source["sampler"],
                 "kl_ctrl": self.kl_ctrl.state_dict(),
                 "total_training_steps": self.total_training_steps}
        if self.reward_swap is not None:
            state["reward_model_path"] = self.reward_swap.path
        # The step's metrics ride in the checkpoint: a run that dies between the save and the log line re-logs
        # them on resume (the resumed run starts after this step and would never log it).
        state["step_metrics"] = {k: float(v) for k, v in (step_metrics or {}).items() if isinstance(v, numbers.Real)}
        state.update(source)  # what else the source keeps (an asynchronous run's replay buffer), after
        return state

    def save(self, step: int, step_metrics: dict[str, Any] | None) -> None:
        """Step ``step``'s checkpoint (``step_metrics``: its metrics, logged again by a resume that finds them
        missing), older ones pruned."""
        def save_models(staging: str) -> None:
            self.roles.actor_rollout_wg.save_checkpoint(os.path.join(staging, "actor"))
            if self.roles.critic_wg is not None:
                self.roles.critic_wg.save_checkpoint(os.path.join(staging, "critic"))
            self.source.save_files(staging)

        trainer = self.sections.trainer
        keep = {"actor": trainer.max_actor_ckpt_to_keep, "critic": trainer.max_critic_ckpt_to_keep}
        with self.timer("save_checkpoint"):
            path = ckpt.save_trainer_checkpoint(trainer.default_local_dir, step, self._trainer_state(step_metrics),
                                                save_models, max_to_keep=keep)
            if self.rank == 0:
                removed = ckpt.prune_checkpoints(trainer.default_local_dir, step, keep)
                if removed:
                    self.say(f"checkpoint: removed {', '.join(removed)} (trainer.max_actor_ckpt_to_keep="
                             f"{trainer.max_actor_ckpt_to_keep}, max_critic_ckpt_to_keep="
                             f"{trainer.max_critic_ckpt_to_keep})")
        self.say(f"checkpoint: step {step} -> {path}")

    def load(self) -> dict[str, Any] | None:
        """Resume per ``trainer.resume_mode``: the models, the KL controller, the RNG, the reward model in use and
        the source's state restored; returns the checkpoint's trainer state (``step``, ``step_metrics``), or None
        when there is nothing to resume."""
        trainer = self.sections.trainer
        path = ckpt.find_resume_dir(trainer.default_local_dir, trainer.resume_mode, trainer.resume_from_path)
        if path is None:
            return None
        state = ckpt.load_trainer_state(path)
        self.roles.actor_rollout_wg.load_checkpoint(os.path.join(path, "actor"))
        if self.roles.critic_wg is not None:
            self.roles.critic_wg.load_checkpoint(os.path.join(path, "critic"))
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        ckpt.set_rng_state(state["_rng"])
        swap = self.reward_swap
        if swap is not None and state.get("reward_model_path", swap.path) != swap.path:
            swap.swap(state["reward_model_path"])
        # The sampler and what else the source kept (an async source reissues prompts at the state's step).
        self.source.load_files(path)
        self.source.load_state_dict(state)
        self.say(f"resumed from {path} at step {int(state['step'])}")
        return state
