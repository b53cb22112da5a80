"""The PPO trainer's checkpoints and HF export: models, the trainer state (KL controller, reward model in use)
and what the batch source keeps (the sampler's consumed position; an asynchronous run's replay buffer), pruned
to ``trainer.max_*_ckpt_to_keep``; resume per ``trainer.resume_mode``; ``<output_dir>/actor_hf`` after a save
(``export_hf_every_save``) or at the end (``export_hf_at_end``)."""

from __future__ import annotations

import numbers
import os
from typing import Any

from verl.utils import checkpoint as ckpt


class Checkpointing:
    """Save, resume and export (reads the trainer's worker groups, ``kl_ctrl``, ``source``, ``global_step``)."""

    def export_hf(self) -> None:
        path = os.path.join(self.sections.trainer.output_dir, "actor_hf")
        with self._timer("export_hf"):
            self.actor_rollout_wg.export_hf(path)
        self._exported_step = self.global_step
        self._print(f"HF export: step {self.global_step} -> {path}")

    def _trainer_state(self) -> dict[str, Any]:
        source = self.source.state_dict()
        state = {"sampler": source["sampler"],
                 "kl_ctrl": self.kl_ctrl.state_dict(),
                 "total_training_steps": self.total_training_steps}
        if self.use_rm:
            state["reward_model_path"] = self.rm_path
        # The step's metrics ride in the checkpoint: a run that dies between the save and the log line re-logs
        # them on resume (the resumed run starts after this step and would never log it).
        state["step_metrics"] = {k: float(v) for k, v in (getattr(self, "_step_metrics", None) or {}).items()
                                 if isinstance(v, numbers.Real)}
        state.update(source)  # what else the source keeps (an asynchronous run's replay buffer), after
        return state

    def save_checkpoint(self) -> None:
        def save_models(staging: str) -> None:
            self.actor_rollout_wg.save_checkpoint(os.path.join(staging, "actor"))
            if self.critic_wg is not None:
                self.critic_wg.save_checkpoint(os.path.join(staging, "critic"))
            self.source.save_files(staging)

        trainer = self.sections.trainer
        keep = {"actor": trainer.max_actor_ckpt_to_keep, "critic": trainer.max_critic_ckpt_to_keep}
        with self._timer("save_checkpoint"):
            path = ckpt.save_trainer_checkpoint(trainer.default_local_dir, self.global_step,
                                                self._trainer_state(), save_models, max_to_keep=keep)
            if self.rank == 0:
                removed = ckpt.prune_checkpoints(trainer.default_local_dir, self.global_step, keep)
                if removed:
                    self._print(f"checkpoint: removed {', '.join(removed)} (trainer.max_actor_ckpt_to_keep="
                                f"{trainer.max_actor_ckpt_to_keep}, max_critic_ckpt_to_keep="
                                f"{trainer.max_critic_ckpt_to_keep})")
        self._print(f"checkpoint: step {self.global_step} -> {path}")
        if self.sections.trainer.export_hf_every_save:
            self.export_hf()

    def load_checkpoint(self) -> None:
        path = ckpt.find_resume_dir(self.sections.trainer.default_local_dir, self.sections.trainer.resume_mode,
                                     self.sections.trainer.resume_from_path)
        if path is None:
            return
        state = ckpt.load_trainer_state(path)
        self.actor_rollout_wg.load_checkpoint(os.path.join(path, "actor"))
        if self.critic_wg is not None:
            self.critic_wg.load_checkpoint(os.path.join(path, "critic"))
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        ckpt.set_rng_state(state["_rng"])
        self.global_step = int(state["step"])
        self._resumed_step_metrics = state.get("step_metrics") or {}
        if self.use_rm and state.get("reward_model_path", self.rm_path) != self.rm_path:
            self.swap_reward_model(state["reward_model_path"])
        # The sampler and what else the source kept; after global_step: an async source reissues prompts at it.
        self.source.load_files(path)
        self.source.load_state_dict(state)
        self._print(f"resumed from {path} at step {self.global_step}")
