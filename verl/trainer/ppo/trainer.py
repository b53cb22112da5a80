"""The single-controller PPO trainer (docs/architecture.md, "One PPO step"), run SPMD on every rank.

Every rank executes :meth:`PPOTrainer.fit` with the same data; each worker-group call splits the
batch over that role's ranks and hands every rank the gathered result, so the loop reads as the
sequential dataflow of HybridFlow:

    prompts -> update weights (reshard in) -> generate (sample, release) -> reward -> old log-probs
    -> ref log-probs -> values -> KL-in-reward / advantages -> update critic -> update actor

Each phase is timed (``timing_s/<phase>``, verl's names; ``update_weights`` is the reshard, on its
own as in verl, not inside ``gen``); together they are ``timing_s/step``. Validation and checkpoints
after a step are timed outside it (``timing_s/testing``, ``timing_s/save_checkpoint``).

PPO with critic + GAE; GRPO / RLOO / REINFORCE++ (+baseline) / ReMax without a critic; the reference
policy when the KL is in the reward or in the loss. Only rank 0 logs and prints.

ReMax (``algorithm.adv_estimator=remax``) also generates one greedy response per prompt
(``do_sample=False``, timed as ``gen_max``, after its own weight sync, added to ``update_weights``);
its sequence reward is the prompt's ``reward_baselines``.

Model-based reward (``reward_model.enable=true``): the reward-model worker writes ``rm_scores`` and
the reward manager passes them through as ``token_level_scores`` (verl's behaviour). Hot swap,
between steps, before the step's rewards:
  - ``reward_model.hot_swap.watch=true``: rank 0 fingerprints ``reward_model.model.path`` (resolved
    path, inode, every file's name/size/mtime) before each step; when it changed, every rank reloads
    it. Publish a new model atomically: write it elsewhere, then rename it onto the path or re-point
    a symlink;
  - ``reward_model.hot_swap.path=DIR`` and ``hot_swap.at_step=K``: load DIR before step K.
A swap logs ``reward_model/swapped`` = 1 for that step; checkpoints record the reward model in use
and a resumed run loads it again.

HF export (``trainer.export_hf_every_save``, ``trainer.export_hf_at_end``): the actor goes to
``<trainer.output_dir>/actor_hf/`` (see ``verl/models/hf_export.py``) after each checkpoint and/or
when training completes.

verl's trainer keys, as verl's ``RayPPOTrainer`` reads them:
  - ``trainer.critic_warmup``: the actor updates from the step ``critic_warmup <= step`` on (steps count
    from 1); before, generation, rewards, values and the critic update run as usual;
  - ``trainer.balance_batch``: right after generation the batch is reordered so that each actor DP rank's
    share holds a near-equal number of valid tokens (``global_seqlen/*`` metrics); rows move only within
    the mini-batches' slices, so every mini-batch keeps its sequences (see :func:`balance_layout`);
  - ``trainer.rollout_data_dir`` / ``trainer.validation_data_dir``: each step's generations / each
    validation's as ``<dir>/<step>.jsonl`` (input, output, gts, score, step), written by rank 0;
  - ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep``: older checkpoints' parts deleted
    after each save (:func:`verl.utils.checkpoint.prune_checkpoints`);
  - ``data.dataloader_num_workers``: forked loader workers (:func:`rl_dataloader`); checkpoints record the
    batches the loop consumed, not the sampler's prefetched position.

The trainer is built from parts, one module a concern, each constructed here with what it reads (the shared
pieces are :mod:`.context`'s: the roles, the phase timer, the training prompts); no part reads the trainer's members
or another part's. The step's dataflow (:class:`~.step.PPOStep`) and its closing metrics (:mod:`.step_metrics`);
where a step's batches come from (:mod:`.batch_source`: sync here, the asynchronous modes' in :mod:`verl.trainer.v1`,
each handed a :class:`~.batch_source.SourceContext`); checkpoints and HF export (:mod:`.checkpointing`); validation
(:mod:`.validation`); the reward-model hot swap (:mod:`.reward_swap`); the Python API's manual steps
(:mod:`.manual_steps`); generation dumps (:mod:`.generations`) and the dataloaders (:mod:`.data`). This module wires
the worker groups and the parts, and runs the loop: resume, steps from the batch source until
``total_training_steps`` or a preemption (SIGUSR1/SIGTERM/SIGHUP/SIGINT: finish the step, checkpoint, exit 0),
validation and checkpoints when due, each step's metrics logged (rank 0), and the final HF export.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tqdm import tqdm

from verl.algorithms import core_algos
from verl.errors import InputError
from verl.protocol import DataProto
from verl.single_controller import WorkerGroup
from verl.single_controller.generation_wait import GenerationWait
from verl.trainer.config.sections import PPOSections
from verl.trainer.ppo.batch_source import BatchSource, SourceContext, SyncBatchSource
from verl.trainer.ppo.checkpointing import Checkpointing
from verl.trainer.ppo.context import PhaseTimer, Roles, TrainData
from verl.trainer.ppo.data import PREFETCH_BATCHES, PROMPT_FIELDS, balance_layout, rl_dataloader
from verl.trainer.ppo.generations import generation_records, write_generations
from verl.trainer.ppo.manual_steps import ManualSteps, RewardWorkerHandle
from verl.trainer.ppo.reward_swap import RewardModelSwap
from verl.trainer.ppo.step import PPOStep
from verl.trainer.ppo.step_metrics import StepEndMetrics
from verl.trainer.ppo.validation import Validation
from verl.utils.flops_counter import device_peak_flops
from verl.utils.timeline import Timeline
from verl.utils.tracking import rank_zero_tracking

__all__ = ["PREFETCH_BATCHES", "PROMPT_FIELDS", "PPOTrainer", "balance_layout", "generation_records",
           "rl_dataloader", "write_generations"]


class PPOTrainer:
    """verl's PPO trainer over this process's worker groups. ``batch_source_class``: where its steps' batches
    come from (the asynchronous trainers of :mod:`verl.trainer.v1` name theirs)."""

    batch_source_class: type[BatchSource] = SyncBatchSource

    def __init__(self, config: Any, tokenizer: Any = None, dry_run: bool = False, *, train_dataset: Any = None):
        """``config``: the loaded config (verl's DictConfig, kept as ``self.config``); the loop reads it through
        its typed sections, ``self.sections``, built once here; each worker receives its own section.

        Without ``tokenizer`` (the Python API: ``PPOTrainer(config)``), ``config`` is what a user writes -- a dict,
        an OmegaConf config or a YAML path with verl's keys -- and this does what `verl train` does first, in this
        process (:func:`verl.trainer.prepare.prepare`: validate, torch.distributed as a world of one unless a
        launcher started the process, the tokenizer). ``train_dataset``: an RLHFDataset in place of
        ``data.train_files``'s."""
        import torch.distributed as dist

        from verl.utils.dataset.rl_dataset import RLHFDataset, create_rl_sampler
        from verl.utils.reward_score import load_reward_fn
        from verl.workers.reward_manager import reward_manager_cls

        if tokenizer is None:
            from verl.trainer.prepare import prepare

            config, tokenizer, _ = prepare(config)
        self.config, self.tokenizer, self.dry_run = config, tokenizer, dry_run
        self.sections = sections = PPOSections.from_tree(config, "")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

        data = sections.data
        self.train_dataset = train_dataset if train_dataset is not None else RLHFDataset(
            data.train_files, tokenizer, data, max_samples=data.train_max_samples)
        self.sampler = create_rl_sampler(data, self.train_dataset)
        if len(self.train_dataset) < data.train_batch_size:
            raise InputError(f"data.train_batch_size={data.train_batch_size}: expected at most the "
                             f"{len(self.train_dataset)} training prompts, found a larger batch")
        self.train_dataloader = rl_dataloader(self.train_dataset, data.train_batch_size, data.dataloader_num_workers,
                                              sampler=self.sampler, drop_last=True)
        self.val_dataloader = None
        if data.val_files:
            val_dataset = RLHFDataset(data.val_files, tokenizer, data, max_samples=data.val_max_samples)
            self.val_dataloader = rl_dataloader(val_dataset, data.val_batch_size or len(val_dataset),
                                                data.dataloader_num_workers)
        steps = len(self.train_dataloader) * sections.trainer.total_epochs
        if sections.trainer.total_training_steps is not None:
            steps = sections.trainer.total_training_steps
        self.total_training_steps = 1 if dry_run else steps

        custom = sections.custom_reward_function
        compute_score = load_reward_fn(custom.path, custom.name) if custom.path else None
        manager = reward_manager_cls(sections)
        reward_fn = manager(tokenizer, num_examine=0, compute_score=compute_score, reward_fn_key=data.reward_fn_key)
        from verl.workers.reward_manager import NaiveRewardManager

        if isinstance(reward_fn, NaiveRewardManager):  # reward.timeout_s in the step's own process
            reward_fn.timeout_s = sections.reward.timeout_s
        kl_ctrl = core_algos.get_kl_controller(sections.algorithm.kl_ctrl)
        dp_size, balance_block = balance_layout(sections, self.world_size)
        self.roles = roles = Roles(self._build_actor_rollout(sections, tokenizer), reward_fn=reward_fn)
        self._build_reward_and_critic(sections)
        self.global_step = 0
        self._exported_step: int | None = None
        self._step_metrics: dict[str, Any] | None = None
        self._resumed_step_metrics: dict[str, Any] = {}
        self.tracking = None

        # The parts, each given what it reads.
        from verl.models.config import ModelConfig

        arr = sections.actor_rollout_ref
        self.timer = timer = PhaseTimer(self._print)
        self.reward_swap = RewardModelSwap(sections, roles, timer, rank=self.rank, say=self._print) \
            if sections.reward_model.enable else None
        # perf/mfu/*: the models' shapes and this device's promised FLOP/s (None on CPU: no mfu).
        self.end_metrics = StepEndMetrics(
            sections, roles, timer, tokenizer, world_size=self.world_size, peak_flops=device_peak_flops(),
            actor_model_config=ModelConfig.from_pretrained(arr.model.path),
            critic_model_config=ModelConfig.from_pretrained(sections.critic.model.path)
            if roles.critic_wg is not None else None)
        self.ppo_step = PPOStep(sections, roles, timer, kl_ctrl, tokenizer, self.end_metrics, rank=self.rank,
                                off_policy=self.batch_source_class.off_policy, dry_run=dry_run, dp_size=dp_size,
                                balance_block=balance_block, reward_swap=self.reward_swap)
        self.source = self.batch_source_class(SourceContext(
            sections, tokenizer, self.rank, self.world_size, roles,
            TrainData(self.train_dataset, self.sampler, self.train_dataloader), self.ppo_step, timer,
            self.end_metrics))
        self.checkpoints = Checkpointing(sections, roles, timer, kl_ctrl, self.source, rank=self.rank,
                                         say=self._print, total_training_steps=self.total_training_steps,
                                         reward_swap=self.reward_swap)
        self.validation = Validation(sections, roles, self.ppo_step, self.val_dataloader, tokenizer, rank=self.rank)
        self.manual = ManualSteps(self.ppo_step, self.end_metrics, timer, self.train_dataloader)

    def _build_actor_rollout(self, sections: PPOSections, tokenizer: Any) -> WorkerGroup:
        from verl.trainer.config import use_reference
        from verl.workers.actor_rollout_ref_worker import ActorRolloutRefWorker

        # Each worker receives its own section and the few facts it needs from the rest.
        arr, data, seed = sections.actor_rollout_ref, sections.data, sections.trainer.seed
        role = "actor_rollout_ref" if use_reference(sections) else "actor_rollout"
        val_rows = (data.val_batch_size or data.train_batch_size) * arr.rollout.val_kwargs.n
        # After a generation call the ranks wait for the slowest rollout up to the rollout's own deadline.
        wait = GenerationWait(arr.rollout.generation_timeout, arr.rollout.tensor_model_parallel_size)
        return WorkerGroup(
            ActorRolloutRefWorker, arr, role, self.total_training_steps, tokenizer, seed=seed,
            bucket_bytes=sections.hybrid_engine.bucket_bytes, response_length=data.max_response_length,
            max_seq_len=data.max_prompt_length + data.max_response_length,
            max_batch_rows=max(data.train_batch_size * arr.rollout.n, val_rows), name="actor_rollout_ref",
            generation_wait=wait)

    def _build_reward_and_critic(self, sections: PPOSections) -> None:
        from verl.trainer.config import use_critic

        arr, seed = sections.actor_rollout_ref, sections.trainer.seed
        if use_critic(sections):
            from verl.workers.critic_worker import CriticWorker

            self.roles.critic_wg = WorkerGroup(CriticWorker, sections.critic, self.total_training_steps,
                                               rollout_n=arr.rollout.n, seed=seed, name="critic")
        if sections.reward_model.enable:
            from verl.workers.reward_model_worker import RewardModelWorker

            self.roles.rm_wg = WorkerGroup(RewardModelWorker, sections.reward_model, layout_role=arr.actor,
                                           seed=seed, judge=sections.reward.reward_model, name="reward_model")

    # ------------------------------------------------------------------ the roles, as verl's trainer names them
    # Read and written in ``roles``, where the parts read them (the Python API replaces the actor's group and the
    # reward function after the trainer is built).
    actor_rollout_wg = property(lambda self: self.roles.actor_rollout_wg,
                                lambda self, group: setattr(self.roles, "actor_rollout_wg", group))
    critic_wg = property(lambda self: self.roles.critic_wg)
    rm_wg = property(lambda self: self.roles.rm_wg)
    reward_fn = property(lambda self: self.roles.reward_fn, lambda self, fn: setattr(self.roles, "reward_fn", fn))

    @property
    def rm_path(self) -> str | None:
        """The reward model in use (None without one)."""
        return self.reward_swap.path if self.reward_swap is not None else None

    # ------------------------------------------------------------------ the run loop
    def fit(self) -> int:
        """Train to ``total_training_steps`` (or until preempted); returns the process exit code."""
        from verl.launcher.preemption import TRAINER_SIGNALS, PreemptionHandler

        trainer = self.sections.trainer
        if not self.dry_run:
            self.load_checkpoint()
        self.tracking = rank_zero_tracking(self.config, self.rank)
        if self.rank == 0:
            self.timer.timeline = Timeline(trainer.output_dir)
        self._relog_checkpointed_step()
        validate = self.val_dataloader is not None and not self.dry_run
        if validate and trainer.val_before_train and self.global_step == 0:
            with self.timer("testing"):
                val = self.validate()
            self._log(val, 0)
        # A bar only on a terminal: through pipes (spawned ranks, Slurm logs) the console line is the progress.
        progress = tqdm(total=self.total_training_steps, initial=self.global_step, desc="training", file=sys.stderr,
                        disable=self.rank != 0 or not sys.stderr.isatty(), dynamic_ncols=True)
        # Ctrl-C (SIGINT) and a lost terminal (SIGHUP) too: finish the step, checkpoint, exit 0 -- so the run resumes.
        with PreemptionHandler(signals=TRAINER_SIGNALS) as preempt:
            preempted = self._train_loop(validate, preempt, progress)
        progress.close()
        if (trainer.export_hf_at_end and not self.dry_run and not preempted
                and self.global_step >= self.total_training_steps
                and self._exported_step != self.global_step):
            self.export_hf()
        if preempted:
            self._print(f"preempted: stopped after step {self.global_step} with a checkpoint; exiting 0")
        if self.tracking is not None:
            self.tracking.close()
        return 0

    def _train_loop(self, validate: bool, preempt: Any, progress: Any) -> bool:
        """Steps until ``total_training_steps`` or a preemption (returned), each from the batch source's next
        input."""
        from verl.launcher import startup

        preempted, first = False, True
        self.source.start(self.global_step)
        inputs = self.source.step_inputs()
        try:
            while self.global_step < self.total_training_steps and not preempted:
                step_input, extra = next(inputs)
                step = self.global_step + 1
                metrics = self.train_step(step_input, step)
                metrics.update(extra)
                if first:  # this process's first step: how long the run took to get here (verl.launcher.startup)
                    first, now = False, time.time()
                    metrics["perf/time_to_first_step_s"] = now - startup.launch_time()
                    self._print(startup.summary_line(now))
                last, preempted = self._end_step(metrics, step, validate, preempt)
                progress.update(1)
                if last:
                    break
        finally:
            inputs.close()  # the dataloader's pass (and its forked workers) ends with the loop
        return preempted

    def _end_step(self, metrics: dict[str, float], step: int, validate: bool, preempt: Any) -> tuple[bool, bool]:
        """After step ``step``'s update: validation and checkpoint when due (or when preempted), then the step's
        metrics logged; returns (the last step, preempted)."""
        trainer = self.sections.trainer
        metrics["training/global_step"] = step
        self.global_step = step
        last = step >= self.total_training_steps
        if validate and trainer.test_freq > 0 and (step % trainer.test_freq == 0 or last):
            with self.timer("testing"):
                metrics.update(self.validate())
            metrics["timing_s/testing"] = self.timer.timing["testing"]
        saved = False
        self._step_metrics = metrics  # saved with the checkpoint (see _relog_checkpointed_step)
        if not self.dry_run and trainer.save_freq > 0 and (step % trainer.save_freq == 0 or last):
            self.save_checkpoint()
            saved = True
        preempted = preempt.should_stop()
        if preempted and not saved and not self.dry_run:
            self.save_checkpoint()
        if "save_checkpoint" in self.timer.timing:
            metrics["timing_s/save_checkpoint"] = self.timer.timing["save_checkpoint"]
        self._log(metrics, step)
        return last, preempted

    def _relog_checkpointed_step(self) -> None:
        """A resumed run whose checkpoint's step never reached metrics.jsonl (the run died between the save and
        the log line) logs it from the metrics the checkpoint carries."""
        metrics, step = self._resumed_step_metrics, self.global_step
        if self.rank != 0 or not metrics or step == 0:
            return
        from verl.utils.tracking import METRICS_FILE, MetricsError, read_metrics

        path = os.path.join(self.sections.trainer.output_dir, METRICS_FILE)
        try:
            logged = {record["step"] for record in read_metrics(path)} if os.path.isfile(path) else set()
        except MetricsError as err:  # a damaged metrics file: say so, and leave it be
            self._print(f"resume: {err}")
            return
        # Only the run that logged the steps before it (a checkpoint resumed into another output directory is
        # not this run's history to complete).
        if step in logged or not any(s < step for s in logged):
            return
        self._print(f"resume: step {step}'s metrics were not logged before the run ended: logging them from its "
                    "checkpoint")
        self._log(dict(metrics), step)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracking is not None:
            self.tracking.log(metrics, step, total_steps=self.total_training_steps)
        if self.timer.timeline is not None:
            self.timer.timeline.write(step)

    # ------------------------------------------------------------------ what the loop and the API call
    def train_step(self, step_input: Any, step: int) -> dict[str, float]:
        """Step ``step`` from what the batch source handed the loop; returns its metrics."""
        return self.ppo_step.run(self.source, step_input, step)

    def validate(self) -> dict[str, float]:
        """Greedy decoding (rollout.val_kwargs) on the validation set: val/accuracy and val-core names."""
        return self.validation(self.global_step)

    def save_checkpoint(self) -> None:
        self.checkpoints.save(self.global_step, self._step_metrics)
        if self.sections.trainer.export_hf_every_save:
            self.export_hf()

    def load_checkpoint(self) -> None:
        state = self.checkpoints.load()
        if state is not None:
            self.global_step = int(state["step"])
            self._resumed_step_metrics = state.get("step_metrics") or {}

    def export_hf(self) -> None:
        self.checkpoints.export_hf(self.global_step)
        self._exported_step = self.global_step

    def swap_reward_model(self, path: str) -> None:
        """Load ``path`` as the reward model on every rank, between steps."""
        if self.reward_swap is None:
            raise InputError("swap_reward_model: expected reward_model.enable=true, found no reward model")
        self.reward_swap.swap(path)

    @property
    def reward_worker(self) -> RewardWorkerHandle:
        if self.reward_swap is None:
            raise InputError("reward_worker: expected reward_model.enable=true, found no reward model in the config")
        return RewardWorkerHandle(self.reward_swap, self.roles)

    def rollout(self, batch: Any = None) -> DataProto:
        """Step ``global_step + 1``'s experience by hand (:mod:`verl.trainer.ppo.manual_steps`)."""
        return self.manual.rollout(batch, self.global_step + 1)

    def update(self, rollout_data: Any) -> dict[str, float]:
        """The updates on what :meth:`rollout` returned; returns the step's metrics and advances ``global_step``."""
        metrics = self.manual.update(rollout_data)
        self.global_step = int(metrics["training/global_step"])
        return metrics

    # ------------------------------------------------------------------ helpers
    def _print(self, text: str) -> None:
        """The trainer's console lines (what `verl train` shows), above the progress bar; rank 0 only."""
        if self.rank == 0:
            tqdm.write(text, file=sys.stdout)

    def close(self) -> None:
        """Stop what the workers started beyond this process's memory (an SGLang engine's schedulers);
        called on every exit path of a rank, including errors (idempotent)."""
        worker = self.actor_rollout_wg.worker
        if worker is not None:
            worker.shutdown()
