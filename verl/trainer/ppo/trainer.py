"""The single-controller PPO loop (docs/architecture.md, "One PPO step"), run SPMD on every rank.

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
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from verl.algorithms import core_algos
from verl.errors import InputError
from verl.protocol import DataProto
from verl.single_controller import WorkerGroup, all_gather_objects, broadcast_object, data_plane
from verl.single_controller.data_plane import ShardedBatch
from verl.trainer import metrics as metric_utils
from verl.trainer.config import actor_dp_size, use_critic, use_reference
from verl.trainer.config.sections import PPOSections
from verl.trainer.ppo import batch_ops
from verl.trainer.ppo.advantage import apply_kl_penalty, compute_response_mask
from verl.utils import checkpoint as ckpt
from verl.utils.flops_counter import device_peak_flops
from verl.utils.seqlen_balancing import balanced_dp_order, seqlen_balance_metrics
from verl.utils.timeline import TRAINER_LANE, Timeline
from verl.utils.torch_functional import masked_mean
from verl.utils.tracking import rank_zero_tracking

PROMPT_FIELDS = ("input_ids", "attention_mask", "position_ids")
# Per DataLoader worker, batches loaded ahead (torch's default is 2): workers are forks of a rank.
PREFETCH_BATCHES = 1


def _worker_dies_with_rank(rank_pid: int, worker_id: int) -> None:
    from verl.launcher.spawn import die_with_parent

    die_with_parent(rank_pid)


def rl_dataloader(dataset: Any, batch_size: int, num_workers: int, sampler: Any = None, drop_last: bool = False):
    """verl's dataloader for ``dataset`` with ``data.dataloader_num_workers`` workers, capped at the batches
    of one pass (a worker loads whole batches). Workers are forks of this rank that die with it, started per
    pass (not persistent) and loading one batch ahead each, so they hold little memory. The sampler's own
    position then runs ahead of what the loop consumed: the trainer checkpoints its consumed count instead."""
    from torch.utils.data import DataLoader

    from verl.utils.dataset.rl_dataset import collate_fn

    batches = len(dataset) // batch_size if drop_last else -(-len(dataset) // batch_size)
    workers = min(int(num_workers), max(batches, 1))
    options: dict[str, Any] = {}
    if workers > 0:
        import functools
        import multiprocessing

        options = dict(prefetch_factor=PREFETCH_BATCHES, persistent_workers=False,
                       worker_init_fn=functools.partial(_worker_dies_with_rank, os.getpid()))
        if "fork" in multiprocessing.get_all_start_methods():
            options["multiprocessing_context"] = "fork"
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False, collate_fn=collate_fn,
                      drop_last=drop_last, num_workers=workers, **options)


def balance_layout(config: Any, world_size: int) -> tuple[int, int]:
    """(actor DP size, rows per rank whose set ``balance_batch`` keeps). Each DP rank cuts its share into
    mini-batches of ppo_mini_batch_size * n / dp rows (actor, and critic when there is one); a block that
    divides both keeps every mini-batch's set of sequences, so the balanced step optimises the same thing.
    A role that shuffles its mini-batches (``shuffle``) draws them at random from the rank's share anyway."""
    arr = config.actor_rollout_ref
    dp = actor_dp_size(config, world_size)
    n = arr.rollout.n
    roles = [arr.actor] + ([config.critic] if use_critic(config) else [])
    sizes = [role.ppo_mini_batch_size * n // dp for role in roles if not role.shuffle]
    return dp, math.gcd(*sizes) if sizes else config.data.train_batch_size * n // dp


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def generation_records(batch: DataProto, scores: torch.Tensor, extra_info: dict[str, list], tokenizer: Any,
                       step: int) -> list[dict[str, Any]]:
    """verl's dumped generation fields per row: input (the prompt's text), output (the response's), gts
    (reward_model.ground_truth), score (the sequence score), step, and the reward function's extra info."""
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    mask = batch.batch["attention_mask"].bool()
    prompt_mask, response_mask = mask[:, :prompts.shape[-1]], mask[:, prompts.shape[-1]:]
    rows = len(batch)
    reward_models = batch.non_tensor_batch.get("reward_model", [None] * rows)
    score = scores.sum(-1).tolist()
    extra = {k: v for k, v in (extra_info or {}).items() if len(v) == rows}
    records = []
    for i in range(rows):
        ground_truth = reward_models[i].get("ground_truth") if isinstance(reward_models[i], dict) else None
        records.append({
            "input": tokenizer.decode(prompts[i][prompt_mask[i]].tolist(), skip_special_tokens=True),
            "output": tokenizer.decode(responses[i][response_mask[i]].tolist(), skip_special_tokens=True),
            "gts": ground_truth, "score": score[i], "step": step, **{k: v[i] for k, v in extra.items()}})
    return records


def write_generations(directory: str, step: int, records: list[dict[str, Any]]) -> str:
    """``<directory>/<step>.jsonl``, one record a line (verl's rollout/validation dumps), written atomically."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False, default=_jsonable) + "\n")
    os.replace(path + ".tmp", path)
    return path


class PPOTrainer:
    # Rank 0's run timeline from fit() on (<output_dir>/timeline.jsonl); None elsewhere and before.
    timeline: Timeline | None = None

    def __init__(self, config: Any, tokenizer: Any, dry_run: bool = False):
        """``config``: the loaded config (verl's DictConfig, kept as ``self.config``); the loop reads it through
        its typed sections, ``self.sections``, built once here; each worker receives its own section."""
        import torch.distributed as dist

        from verl.utils.dataset.rl_dataset import RLHFDataset, create_rl_sampler
        from verl.utils.reward_score import load_reward_fn
        from verl.workers.reward_manager import get_reward_manager_cls

        self.config, self.tokenizer, self.dry_run = config, tokenizer, dry_run
        self.sections = sections = PPOSections.from_tree(config, "")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.use_critic = use_critic(sections)
        self.use_reference = use_reference(sections)
        self.debug = sections.trainer.debug
        self.bypass_old_log_prob = sections.algorithm.rollout_correction.bypass_mode
        self.off_policy = False  # the asynchronous trainers train on older weights' rollouts: rollout_corr/* logged

        data = sections.data
        self.train_dataset = RLHFDataset(data.train_files, tokenizer, data, max_samples=data.train_max_samples)
        self.sampler = create_rl_sampler(data, self.train_dataset)
        if len(self.train_dataset) < data.train_batch_size:
            raise InputError(f"data.train_batch_size={data.train_batch_size}: expected at most the "
                             f"{len(self.train_dataset)} training prompts, found a larger batch")
        self.train_dataloader = rl_dataloader(self.train_dataset, data.train_batch_size, data.dataloader_num_workers,
                                              sampler=self.sampler, drop_last=True)
        # What the loop has consumed (the sampler's own position runs ahead when workers prefetch).
        self.data_epoch, self.data_position = self.sampler.epoch, self.sampler.position
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
        manager = get_reward_manager_cls(sections.reward_model.reward_manager)
        self.reward_fn = manager(tokenizer, num_examine=0, compute_score=compute_score,
                                 reward_fn_key=data.reward_fn_key)
        self.kl_ctrl = core_algos.get_kl_controller(sections.algorithm.kl_ctrl)
        self.dp_size, self.balance_block = balance_layout(sections, self.world_size)

        from verl.workers.actor_rollout_ref_worker import ActorRolloutRefWorker

        # Each worker receives its own section and the few facts it needs from the rest.
        arr, seed = sections.actor_rollout_ref, sections.trainer.seed
        role = "actor_rollout_ref" if self.use_reference else "actor_rollout"
        val_rows = (data.val_batch_size or data.train_batch_size) * arr.rollout.val_kwargs.n
        self.actor_rollout_wg = WorkerGroup(
            ActorRolloutRefWorker, arr, role, self.total_training_steps, tokenizer, seed=seed,
            bucket_bytes=sections.hybrid_engine.bucket_bytes, response_length=data.max_response_length,
            max_seq_len=data.max_prompt_length + data.max_response_length,
            max_batch_rows=max(data.train_batch_size * arr.rollout.n, val_rows), name="actor_rollout_ref")
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
                                     name="reward_model")
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

    # ------------------------------------------------------------------ reward model hot swap
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

    # ------------------------------------------------------------------ HF export
    def export_hf(self) -> None:
        path = os.path.join(self.sections.trainer.output_dir, "actor_hf")
        with self._timer("export_hf"):
            self.actor_rollout_wg.export_hf(path)
        self._exported_step = self.global_step
        self._print(f"HF export: step {self.global_step} -> {path}")

    # ------------------------------------------------------------------ checkpoints
    def _trainer_state(self) -> dict[str, Any]:
        state = {"sampler": self.sampler.state_at(self.data_epoch, self.data_position),
                 "kl_ctrl": self.kl_ctrl.state_dict(),
                 "total_training_steps": self.total_training_steps}
        if self.use_rm:
            state["reward_model_path"] = self.rm_path
        return state

    def save_checkpoint(self) -> None:
        def save_models(staging: str) -> None:
            self.actor_rollout_wg.save_checkpoint(os.path.join(staging, "actor"))
            if self.critic_wg is not None:
                self.critic_wg.save_checkpoint(os.path.join(staging, "critic"))

        trainer = self.sections.trainer
        with self._timer("save_checkpoint"):
            path = ckpt.save_trainer_checkpoint(trainer.default_local_dir, self.global_step,
                                                self._trainer_state(), save_models)
            if self.rank == 0:
                removed = ckpt.prune_checkpoints(trainer.default_local_dir, self.global_step,
                                                 {"actor": trainer.max_actor_ckpt_to_keep,
                                                  "critic": trainer.max_critic_ckpt_to_keep})
                if removed:
                    self._print(f"checkpoint: removed {', '.join(removed)} (trainer.max_actor_ckpt_to_keep="
                                f"{trainer.max_actor_ckpt_to_keep}, max_critic_ckpt_to_keep="
                                f"{trainer.max_critic_ckpt_to_keep})")
        self._print(f"checkpoint: step {self.global_step} -> {path}")
        if self.sections.trainer.export_hf_every_save:
            self.export_hf()

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        """What a subclass saved beside the trainer state (the asynchronous trainers' replay buffer)."""
        if "replay_buffer" in state:
            raise InputError("checkpoint: expected a sync run's checkpoint, found an asynchronous run's (with a "
                             "replay buffer): resume it with the trainer.v1.trainer_mode it was written with")

    def load_checkpoint(self) -> None:
        path = ckpt.find_resume_dir(self.sections.trainer.default_local_dir, self.sections.trainer.resume_mode,
                                     self.sections.trainer.resume_from_path)
        if path is None:
            return
        state = ckpt.load_trainer_state(path)
        self.actor_rollout_wg.load_checkpoint(os.path.join(path, "actor"))
        if self.critic_wg is not None:
            self.critic_wg.load_checkpoint(os.path.join(path, "critic"))
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        ckpt.set_rng_state(state["_rng"])
        self.global_step = int(state["step"])
        if self.use_rm and state.get("reward_model_path", self.rm_path) != self.rm_path:
            self.swap_reward_model(state["reward_model_path"])
        self._load_extra_state(state)
        self._print(f"resumed from {path} at step {self.global_step}")

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy decoding (rollout.val_kwargs) on the validation set: val/accuracy and val-core names."""
        scores, sources, generations = [], [], []
        dump_dir = self.sections.trainer.validation_data_dir
        for batch_dict in self.val_dataloader:
            gen = self._prompt_batch(batch_dict, step=0, validate=True)
            out = self.actor_rollout_wg.generate_sequences(self._on_data_plane(gen))
            out.meta_info.pop("metrics", None)
            scores.append(self._sequence_rewards(out))
            sources.extend(batch_ops.column(out, self.sections.data.reward_fn_key).tolist())
            rows = batch_ops.gather_to_rank0(out) if dump_dir else None
            if rows is not None and self.rank == 0:
                reward = self.reward_fn(rows, return_dict=True)
                generations.extend(generation_records(rows, reward["reward_tensor"], reward["reward_extra_info"],
                                                      self.tokenizer, self.global_step))
        if dump_dir and self.rank == 0:
            write_generations(dump_dir, self.global_step, generations)
        score = torch.cat(scores)
        metrics = {"val/accuracy": score.mean().item(), "val/num_samples": float(score.numel())}
        sources_arr = np.array(sources, dtype=object)
        for source in sorted(set(sources)):
            mask = torch.as_tensor(sources_arr == source)
            metrics[f"val-core/{source}/reward/mean@1"] = score[mask].mean().item()
        return metrics

    # ------------------------------------------------------------------ one step
    def train_step(self, batch_dict: dict[str, Any], step: int) -> dict[str, float]:
        """One PPO step, HybridFlow's script. With ``transfer_queue.enable`` the batch is a ShardedBatch whose
        rows stay on the ranks that produced them; ``batch_ops`` reads the same on both data paths."""
        cfg = self.sections
        with self._step(step) as metrics:
            gen = self._prompt_batch(batch_dict, step, validate=False)
            with self._timer("update_weights"):
                metrics.update(self.actor_rollout_wg.update_weights())
            with self._timer("gen"):
                batch = self.actor_rollout_wg.generate_sequences(self._on_data_plane(gen, step))
            metrics.update(metric_utils.reduce_metrics(batch.meta_info.pop("metrics")))
            batch.meta_info = {"seed": step}
            if cfg.algorithm.adv_estimator == core_algos.AdvantageEstimator.REMAX.value:
                with self._timer("update_weights"):  # generation released the rollout weights
                    self.actor_rollout_wg.update_weights()
                with self._timer("gen_max"):
                    baselines = self._greedy_baseline_rewards(gen).repeat_interleave(cfg.actor_rollout_ref.rollout.n)
                    batch_ops.add_replicated(batch, {"reward_baselines": baselines})
            batch = self._learn(batch, metrics, step)
        return self._step_end_metrics(batch, metrics)

    @contextlib.contextmanager
    def _step(self, step: int) -> Iterator[dict[str, float]]:
        """A step's frame, the same in every trainer mode: fresh timings and data-plane counters, the whole step
        timed as ``timing_s/step``, a due reward-model swap first; yields the step's metrics dict."""
        metrics: dict[str, float] = {}
        self._timing = {}
        data_plane.STATS.reset()
        with self._timer("step"):
            if self.use_rm:
                metrics.update(self._maybe_swap_reward_model(step))
            yield metrics

    def _learn(self, batch, metrics: dict[str, float], step: int):
        """A generated batch -> rewards, old/ref log-probs, values, advantages, critic and actor updates (the
        step after generation; the asynchronous trainers feed it the groups their replay buffer samples)."""
        cfg = self.sections
        if cfg.trainer.balance_batch:
            # Rows move between DP ranks only within the mini-batches' slices (see balance_layout), and
            # the group estimators find groups by uid, not by position: the same step, reordered.
            metrics.update(self._balance_batch(batch))

        with self._timer("reward"):
            if self.use_rm:
                batch.union(self.rm_wg.compute_rm_score(batch))
            batch_ops.add_fields(batch, lambda rows: {"token_level_scores": self.reward_fn(rows)},
                                 batch.keys() if isinstance(batch, ShardedBatch) else ())
        if self.bypass_old_log_prob:
            # verl's rollout_correction.bypass_mode: the rollout's log-probs (same weights, same
            # temperature) are the old policy's; no separate forward, and no actor/entropy metric.
            batch_ops.add_fields(batch, lambda rows: {"old_log_probs": rows.batch["rollout_log_probs"]},
                                 ["rollout_log_probs"], anchor="rollout_log_probs")
        else:
            with self._timer("old_log_prob"):
                old = self.actor_rollout_wg.compute_log_prob(batch)
                batch.union(old)
                metrics["actor/entropy"] = batch_ops.aggregate_rows(batch, "entropys",
                                                                    cfg.actor_rollout_ref.actor.loss_agg_mode)
                batch_ops.pop_fields(batch, ["entropys"])
            metrics.update(self._rollout_correction(batch))
        if self.use_reference:
            with self._timer("ref"):
                batch.union(self.actor_rollout_wg.compute_ref_log_prob(batch))
        if self.use_critic:
            with self._timer("values"):
                batch.union(self.critic_wg.compute_values(batch))
        with self._timer("adv"):
            if cfg.algorithm.use_kl_in_reward:
                metrics.update(self._apply_kl_penalty(batch))
            else:
                batch_ops.add_fields(batch, lambda rows: {"token_level_rewards": rows.batch["token_level_scores"]},
                                     ["token_level_scores"], anchor="token_level_scores")
            batch = batch_ops.compute_advantages(
                batch, cfg.algorithm.adv_estimator, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                num_repeat=cfg.actor_rollout_ref.rollout.n,
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo)
        if not self.dry_run:
            if self.use_critic:
                with self._timer("update_critic"):
                    metrics.update(metric_utils.reduce_metrics(
                        self.critic_wg.update_critic(batch).meta_info["metrics"]))
            # verl: the actor trains once critic_warmup <= the step (steps count from 1).
            if cfg.trainer.critic_warmup <= step:
                with self._timer("update_actor"):
                    metrics.update(metric_utils.reduce_metrics(
                        self.actor_rollout_wg.update_actor(batch).meta_info["metrics"]))
        if cfg.trainer.rollout_data_dir:
            with self._timer("dump_rollout_generations"):
                self._dump_generations(batch, step)
        return batch

    def _step_end_metrics(self, batch, metrics: dict[str, float], on_policy: bool = True) -> dict[str, float]:
        """The step's batch, timing, memory and data-plane metrics; the first step of a process whose batch the
        live weights generated (``on_policy``) checks the rollout's log-probs against the actor's."""
        cfg = self.sections
        metrics.update(batch_ops.step_metrics(batch, self.use_critic, self._timing, self.world_size, self._mfu,
                                              self.bypass_old_log_prob))
        if on_policy and not self._probs_checked:  # a broken weight sync fails loudly at the first step
            metric_utils.check_rollout_probs_diff(metrics, cfg.actor_rollout_ref.rollout.dtype)
            self._probs_checked = True
        metrics.update(metric_utils.reduce_memory_metrics(all_gather_objects(metric_utils.local_memory_metrics())))
        # The legacy path's figures too when asked (`verl bench dispatch --legacy`): they cost a gather.
        if isinstance(batch, ShardedBatch) or os.environ.get("VERL_DATA_PLANE_STATS") == "1":
            metrics.update(self._data_plane_metrics())
        if self.debug:
            rows = batch_ops.gather_to_rank0(batch)
            if rows is not None:
                self._debug_print(rows, metrics)
        return metrics

    # ------------------------------------------------------------------ step helpers
    def _on_data_plane(self, gen: DataProto, step: int = 0) -> DataProto | ShardedBatch:
        """The prompts as the step's first batch: on the data plane replicated (every rank's dataloader read
        the same prompts, so no row moves to reach the rollout)."""
        if not self.sections.transfer_queue.enable:
            return gen
        # Row ids: each step's prompts 2^32 apart (validation in step 0's), so a row's id is unique in a run.
        return ShardedBatch.replicated(gen, first_id=step << 32)

    def _apply_kl_penalty(self, batch) -> dict[str, float]:
        """verl's apply_kl_penalty on both data paths: token_level_rewards with this step's beta; the KL
        controller updated with the batch's mean per-sequence KL."""
        if not isinstance(batch, ShardedBatch):
            _, kl_metrics = apply_kl_penalty(batch, self.kl_ctrl, self.sections.algorithm.kl_penalty)
            return kl_metrics
        penalty, beta = self.sections.algorithm.kl_penalty, self.kl_ctrl.value
        inputs = ["token_level_scores", "old_log_probs", "ref_log_prob", "responses", "attention_mask"]

        def rewards(rows: DataProto) -> dict[str, torch.Tensor]:
            mask = compute_response_mask(rows)
            kld = core_algos.kl_penalty(rows.batch["old_log_probs"], rows.batch["ref_log_prob"],
                                        kl_penalty=penalty) * mask
            return {"token_level_rewards": rows.batch["token_level_scores"] - beta * kld,
                    "sequence_kl": masked_mean(kld, mask=mask, axis=-1)}

        batch_ops.add_fields(batch, rewards, inputs)
        current_kl = batch_ops.batch_sum(batch, lambda rows: rows.batch["sequence_kl"], ["sequence_kl"]) / len(batch)
        batch_ops.pop_fields(batch, ["sequence_kl"])
        self.kl_ctrl.update(current_kl=current_kl, n_steps=len(batch))
        return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}

    def _rollout_correction(self, batch) -> dict[str, float]:
        """verl's ``algorithm.rollout_correction`` (decoupled mode: old log-probs from the actor): rejection
        sampling rewrites ``response_mask``, importance sampling adds ``rollout_is_weights`` for the policy loss;
        the off-policy diagnostics (``rollout_corr/*``) are logged with a correction or an asynchronous trainer."""
        from verl.algorithms.rollout_correction import apply_rollout_correction

        rc = self.sections.algorithm.rollout_correction
        correct = rc.rollout_is is not None or rc.rollout_rs is not None
        if not correct and not self.off_policy:
            return {}  # an on-policy run without a correction: the diagnostics would only restate probs_diff
        fields = ["old_log_probs", "rollout_log_probs", "response_mask"]
        old, rollout, mask = (batch_ops.per_row(batch, lambda rows, k=k: rows.batch[k], [k]) for k in fields)
        new_mask, weights, metrics = apply_rollout_correction(
            old, rollout, mask, rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_rs_threshold,
            batch_normalize=rc.rollout_is_batch_normalize)
        if correct:
            update = {"response_mask": new_mask.to(mask.dtype)}
            if weights is not None:
                update["rollout_is_weights"] = weights
            if isinstance(batch, ShardedBatch):
                batch_ops.pop_fields(batch, ["response_mask"])
                batch_ops.add_replicated(batch, update)
            else:
                batch.batch.update(update)
        return metrics

    def _mfu(self, seqlens) -> dict[str, float]:
        """perf/mfu/* from ``seqlens()`` (every row's valid tokens), asked for only with a known peak."""
        cfg = self.sections
        if self.peak_flops is None:
            return {}
        return metric_utils.compute_mfu_metrics(
            seqlens(), self._timing, self.world_size, self.peak_flops, self.actor_model_config,
            cfg.actor_rollout_ref.actor.ppo_epochs, self.critic_model_config,
            cfg.critic.ppo_epochs if self.use_critic else 1)

    def _data_plane_metrics(self) -> dict[str, float]:
        """What the controller moved this step, the most any rank saw: row bytes plus object-collective bytes
        received (``received``; the legacy path's batches travel as objects), the object share alone, what the
        rank's workers consumed (``shard``), seconds spent moving, and peak resident memory."""
        import resource

        s = data_plane.STATS
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
        stats = all_gather_objects((s.bytes_received + s.object_bytes, s.object_bytes, s.shard_bytes, s.seconds,
                                    peak_mb))
        return {"perf/data_plane_received_mb": max(x[0] for x in stats) / 2**20,
                "perf/data_plane_object_mb": max(x[1] for x in stats) / 2**20,
                "perf/data_plane_shard_mb": max(x[2] for x in stats) / 2**20,
                "perf/data_plane_seconds": max(x[3] for x in stats),
                "perf/data_plane_peak_rss_mb": max(x[4] for x in stats)}

    def _dump_generations(self, batch, step: int) -> None:
        """trainer.rollout_data_dir: the step's generations on rank 0 (rewards recomputed there for their
        extra info on the data plane, where no rank holds the whole batch)."""
        rows = batch_ops.gather_to_rank0(batch)
        if self.rank != 0 or rows is None:
            return
        reward = self.reward_fn(rows, return_dict=True)
        write_generations(self.sections.trainer.rollout_data_dir, step, generation_records(
            rows, rows.batch["token_level_scores"], reward["reward_extra_info"], self.tokenizer, step))

    def _balance_batch(self, batch) -> dict[str, float]:
        """verl's ``_balance_batch``: reorder ``batch`` in place so that each actor DP rank's share holds a
        near-equal number of valid tokens (``attention_mask.sum(-1)``); returns ``global_seqlen/*``."""
        lengths = batch_ops.per_row(batch, lambda rows: rows.batch["attention_mask"].sum(-1),
                                    ["attention_mask"]).tolist()
        order = balanced_dp_order(lengths, self.dp_size, self.balance_block)
        if order != list(range(len(order))):
            batch.reorder(torch.tensor(order))
        return seqlen_balance_metrics(lengths, order, self.dp_size)

    def _greedy_baseline_rewards(self, gen: DataProto) -> torch.Tensor:
        """ReMax: the sequence reward [B] of one greedy (do_sample=False) response per prompt."""
        baseline_gen = DataProto.from_dict({k: gen.batch[k] for k in PROMPT_FIELDS}, dict(gen.non_tensor_batch),
                                           {**gen.meta_info, "do_sample": False})
        baseline = self.actor_rollout_wg.generate_sequences(self._on_data_plane(baseline_gen))
        baseline.meta_info.pop("metrics", None)
        if self.use_rm:
            baseline.union(self.rm_wg.compute_rm_score(baseline))
        return self._sequence_rewards(baseline)

    def _sequence_rewards(self, batch) -> torch.Tensor:
        """[B] sequence rewards of generated rows, on every rank (computed where the rows are)."""
        inputs = batch.keys() if isinstance(batch, ShardedBatch) else ()
        return batch_ops.per_row(batch, lambda rows: self.reward_fn(rows).sum(-1), inputs)

    def _debug_print(self, batch: DataProto, metrics: dict[str, float]) -> None:
        count = 1 if self.debug == "light" else min(4, len(batch))
        response_length = batch.batch["responses"].shape[-1]
        for i in range(count):
            prompt_mask = batch.batch["attention_mask"][i, :-response_length].bool()
            prompt_ids = batch.batch["input_ids"][i, :-response_length][prompt_mask]
            n = int(batch.batch["response_mask"][i].sum())
            line = (f"[debug] sample {i}: prompt={self.tokenizer.decode(prompt_ids.tolist())!r} "
                    f"response={self.tokenizer.decode(batch.batch['responses'][i, :n].tolist())!r} "
                    f"score={batch.batch['token_level_scores'][i].sum().item():.3f} "
                    f"advantage={batch.batch['advantages'][i, 0].item():.3f}")
            if self.debug == "full" and "values" in batch.batch:
                line += f" values={[round(v, 3) for v in batch.batch['values'][i, :n].tolist()]}"
            self._print(line)
        if self.debug == "full":
            losses = {k: round(v, 5) for k, v in metrics.items() if k.endswith("_loss") or k.endswith("loss/mean")}
            self._print(f"[debug] losses {losses}")

    # ------------------------------------------------------------------ the loop
    def fit(self) -> int:
        """Train to ``total_training_steps`` (or until preempted); returns the process exit code."""
        from verl.launcher.preemption import PreemptionHandler

        trainer = self.sections.trainer
        if not self.dry_run:
            self.load_checkpoint()
        self.tracking = rank_zero_tracking(self.config, self.rank)
        if self.rank == 0:
            self.timeline = Timeline(trainer.output_dir)
        validate = self.val_dataloader is not None and not self.dry_run
        if validate and trainer.val_before_train and self.global_step == 0:
            with self._timer("testing"):
                val = self.validate()
            self._log(val, 0)
        # A bar only on a terminal: through pipes (spawned ranks, Slurm logs) the console line is the progress.
        progress = tqdm(total=self.total_training_steps, initial=self.global_step, desc="training", file=sys.stderr,
                        disable=self.rank != 0 or not sys.stderr.isatty(), dynamic_ncols=True)
        # Ctrl-C (SIGINT) too: finish the step, checkpoint, exit 0 -- so an interrupted run resumes.
        with PreemptionHandler(signals=(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)) as preempt:
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
        """Steps until ``total_training_steps`` or a preemption (returned): one train batch of the dataloader
        a step, generated with the current weights (verl's sync mode)."""
        preempted = False
        while self.global_step < self.total_training_steps and not preempted:
            epoch_before = self.sampler.epoch
            self.data_epoch, self.data_position = self.sampler.epoch, self.sampler.position
            for batch_dict in self.train_dataloader:
                step = self.global_step + 1
                metrics = self.train_step(batch_dict, step)
                metrics["training/epoch"] = epoch_before
                self.data_position += len(batch_dict["input_ids"])
                last, preempted = self._end_step(metrics, step, validate, preempt)
                progress.update(1)
                if last or preempted:
                    break
            finished = preempted or self.global_step >= self.total_training_steps
            if self.sampler.epoch == epoch_before and not finished:
                raise RuntimeError("train dataloader: expected a new epoch after a full pass, found none")
        return preempted

    def _end_step(self, metrics: dict[str, float], step: int, validate: bool, preempt: Any) -> tuple[bool, bool]:
        """After step ``step``'s update: validation and checkpoint when due (or when preempted), then the step's
        metrics logged; returns (the last step, preempted)."""
        trainer = self.sections.trainer
        metrics["training/global_step"] = step
        self.global_step = step
        last = step >= self.total_training_steps
        if validate and trainer.test_freq > 0 and (step % trainer.test_freq == 0 or last):
            with self._timer("testing"):
                metrics.update(self.validate())
            metrics["timing_s/testing"] = self._timing["testing"]
        saved = False
        if not self.dry_run and trainer.save_freq > 0 and (step % trainer.save_freq == 0 or last):
            self.save_checkpoint()
            saved = True
        preempted = preempt.should_stop()
        if preempted and not saved and not self.dry_run:
            self.save_checkpoint()
        if "save_checkpoint" in self._timing:
            metrics["timing_s/save_checkpoint"] = self._timing["save_checkpoint"]
        self._log(metrics, step)
        return last, preempted

    def close(self) -> None:
        """Stop what the workers started beyond this process's memory (an SGLang engine's schedulers);
        called on every exit path of a rank, including errors (idempotent)."""
        worker = self.actor_rollout_wg.worker
        if worker is not None:
            worker.shutdown()

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracking is not None:
            self.tracking.log(metrics, step, total_steps=self.total_training_steps)
        if self.timeline is not None:
            self.timeline.write(step)
