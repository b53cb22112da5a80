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

The trainer is assembled from one module per concern: the run loop (:mod:`.loop`: fit, resume, validation and
checkpoints when due, logging, preemption, export), the step's dataflow (:mod:`.step`) and its closing metrics
(:mod:`.step_metrics`), where a step's batches come from (:mod:`.batch_source`: sync here, the asynchronous
modes' in :mod:`verl.trainer.v1`), checkpoints and HF export (:mod:`.checkpointing`), validation
(:mod:`.validation`), the reward-model hot swap (:mod:`.reward_swap`), generation dumps (:mod:`.generations`)
and the dataloaders (:mod:`.data`). This module wires the worker groups.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from tqdm import tqdm

from verl.algorithms import core_algos
from verl.errors import InputError
from verl.protocol import DataProto
from verl.single_controller import WorkerGroup
from verl.single_controller.generation_wait import GenerationWait
from verl.trainer.config import use_critic, use_reference
from verl.trainer.config.sections import PPOSections
from verl.trainer.ppo.batch_source import BatchSource, SyncBatchSource
from verl.trainer.ppo.checkpointing import Checkpointing
from verl.trainer.ppo.data import PREFETCH_BATCHES, PROMPT_FIELDS, balance_layout, rl_dataloader
from verl.trainer.ppo.generations import generation_records, write_generations
from verl.trainer.ppo.loop import RunLoop
from verl.trainer.ppo.manual_steps import ManualSteps
from verl.trainer.ppo.reward_swap import RewardModelSwap
from verl.trainer.ppo.step import StepDataflow
from verl.trainer.ppo.step_metrics import StepMetrics
from verl.trainer.ppo.validation import Validation
from verl.utils.flops_counter import device_peak_flops
from verl.utils.timeline import TRAINER_LANE, Timeline

__all__ = ["PREFETCH_BATCHES", "PROMPT_FIELDS", "PPOTrainer", "balance_layout", "generation_records",
           "rl_dataloader", "write_generations"]


class PPOTrainer(RunLoop, StepDataflow, StepMetrics, Checkpointing, Validation, RewardModelSwap, ManualSteps):
    """verl's PPO trainer over this process's worker groups. ``batch_source_class``: where its steps' batches
    come from (the asynchronous trainers of :mod:`verl.trainer.v1` name theirs)."""

    batch_source_class: type[BatchSource] = SyncBatchSource
    # Rank 0's run timeline from fit() on (<output_dir>/timeline.jsonl); None elsewhere and before.
    timeline: Timeline | None = None

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
        self.use_critic = use_critic(sections)
        self.use_reference = use_reference(sections)
        self.debug = sections.trainer.debug
        self.bypass_old_log_prob = sections.algorithm.rollout_correction.bypass_mode

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
        self.reward_fn = manager(tokenizer, num_examine=0, compute_score=compute_score,
                                 reward_fn_key=data.reward_fn_key)
        from verl.workers.reward_manager import NaiveRewardManager

        if isinstance(self.reward_fn, NaiveRewardManager):  # reward.timeout_s in the step's own process
            self.reward_fn.timeout_s = sections.reward.timeout_s
        self.kl_ctrl = core_algos.get_kl_controller(sections.algorithm.kl_ctrl)
        self.dp_size, self.balance_block = balance_layout(sections, self.world_size)

        from verl.workers.actor_rollout_ref_worker import ActorRolloutRefWorker

        # Each worker receives its own section and the few facts it needs from the rest.
        arr, seed = sections.actor_rollout_ref, sections.trainer.seed
        role = "actor_rollout_ref" if self.use_reference else "actor_rollout"
        val_rows = (data.val_batch_size or data.train_batch_size) * arr.rollout.val_kwargs.n
        # After a generation call the ranks wait for the slowest rollout up to the rollout's own deadline.
        wait = GenerationWait(arr.rollout.generation_timeout, arr.rollout.tensor_model_parallel_size)
        self.actor_rollout_wg = WorkerGroup(
            ActorRolloutRefWorker, arr, role, self.total_training_steps, tokenizer, seed=seed,
            bucket_bytes=sections.hybrid_engine.bucket_bytes, response_length=data.max_response_length,
            max_seq_len=data.max_prompt_length + data.max_response_length,
            max_batch_rows=max(data.train_batch_size * arr.rollout.n, val_rows), name="actor_rollout_ref",
            generation_wait=wait)
        self.critic_wg = None
        if self.use_critic:
            from verl.workers.critic_worker import CriticWorker

            self.critic_wg = WorkerGroup(CriticWorker, sections.critic, self.total_training_steps,
                                         rollout_n=arr.rollout.n, seed=seed, name="critic")
        self.use_rm = sections.reward_model.enable
        self.rm_wg = None
        if self.use_rm:
            from verl.workers.reward_model_worker import RewardModelWorker

            self.rm_wg = WorkerGroup(RewardModelWorker, sections.reward_model, layout_role=arr.actor, seed=seed,
                                     judge=sections.reward.reward_model, name="reward_model")
            self.rm_path = sections.reward_model.model.path
            self._rm_fingerprint = self._watched_rm_fingerprint()
        self.global_step = 0
        self._probs_checked = False
        self._exported_step = None
        self.tracking = None
        self._timing: dict[str, float] = {}
        # perf/mfu/*: the models' shapes and this device's promised FLOP/s (None on CPU: no mfu).
        from verl.models.config import ModelConfig

        self.peak_flops = device_peak_flops()
        self.actor_model_config = ModelConfig.from_pretrained(arr.model.path)
        self.critic_model_config = ModelConfig.from_pretrained(sections.critic.model.path) if self.use_critic \
            else None
        self.source = self.batch_source_class(self)
        # An asynchronous source trains on older weights' rollouts: rollout_corr/* logged.
        self.off_policy = self.source.off_policy

    # ------------------------------------------------------------------ helpers
    def _print(self, text: str) -> None:
        """The trainer's console lines (what `verl train` shows), above the progress bar; rank 0 only."""
        if self.rank == 0:
            tqdm.write(text, file=sys.stdout)

    @contextlib.contextmanager
    def _timer(self, name: str) -> Iterator[None]:
        """Time a phase into ``self._timing[name]``; a phase run twice in a step adds up."""
        start, wall = time.perf_counter(), time.time()
        yield
        seconds = time.perf_counter() - start
        self._timing[name] = self._timing.get(name, 0.0) + seconds
        if self.timeline is not None:
            self.timeline.add(TRAINER_LANE, name, wall, wall + seconds)
        if name != "step":
            self._print(f"[{name}] {seconds:.2f}s")

    def _prompt_batch(self, batch_dict: dict[str, Any], step: int, validate: bool) -> DataProto:
        batch = DataProto.from_single_dict(batch_dict)
        batch.non_tensor_batch["uid"] = np.array([f"{step}-{i}" for i in range(len(batch))], dtype=object)
        gen = DataProto.from_dict({k: batch.batch[k] for k in PROMPT_FIELDS}, dict(batch.non_tensor_batch))
        gen.meta_info = {"seed": self.sections.trainer.seed * 100003 + step, "validate": validate,
                         "eos_token_id": self.tokenizer.eos_token_id, "pad_token_id": self.tokenizer.pad_token_id}
        return gen

    def close(self) -> None:
        """Stop what the workers started beyond this process's memory (an SGLang engine's schedulers);
        called on every exit path of a rank, including errors (idempotent)."""
        worker = self.actor_rollout_wg.worker
        if worker is not None:
            worker.shutdown()
