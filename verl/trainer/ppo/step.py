"""One PPO step's dataflow over the worker groups (docs/architecture.md, "One PPO step"):

    generated batch -> (balance) -> reward -> old log-probs (+ rollout correction) -> ref log-probs -> values
    -> KL-in-reward / advantages -> update critic -> update actor

:class:`PPOStep` is built once by the trainer with what a step reads (the sections, the worker groups and reward
function, the timer, the KL controller, the closing metrics, a reward-model swap). :meth:`PPOStep.run` frames a step
(timings, a due reward-model swap) and asks the batch source it is given (:mod:`verl.trainer.ppo.batch_source`) for
the step's generated batch(es); :meth:`PPOStep.learn` runs the rest on each. The batch sources call
:meth:`~PPOStep.prompt_batch`, :meth:`~PPOStep.generate` and :meth:`~PPOStep.on_data_plane`; the Python API's
manual steps call :meth:`~PPOStep.generate`, :meth:`~PPOStep.experience` and :meth:`~PPOStep.update_models` one by
one. With ``transfer_queue.enable`` a batch is a ShardedBatch whose rows stay on the ranks
that produced them; ``batch_ops`` reads the same on both data paths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from verl.algorithms import core_algos
from verl.errors import InputError
from verl.protocol import DataProto
from verl.single_controller import data_plane
from verl.single_controller.data_plane import ShardedBatch
from verl.trainer import metrics as metric_utils
from verl.trainer.config import use_critic, use_reference
from verl.trainer.ppo import batch_ops
from verl.trainer.ppo.advantage import apply_kl_penalty, compute_response_mask
from verl.trainer.ppo.context import PhaseTimer, Roles
from verl.trainer.ppo.data import PROMPT_FIELDS
from verl.trainer.ppo.generations import generation_records, write_generations
from verl.trainer.ppo.reward_swap import RewardModelSwap
from verl.trainer.ppo.step_metrics import StepEndMetrics
from verl.utils.seqlen_balancing import balanced_dp_order, seqlen_balance_metrics
from verl.utils.torch_functional import masked_mean


class RolloutLogProbsMissing(InputError):
    """Bypass mode over a rollout that returned no log-probs (a custom agent loop's): refused, never zeros."""


class PPOStep:
    """One PPO step's dataflow over the worker groups (see the module doc)."""

    def __init__(self, sections: Any, roles: Roles, timer: PhaseTimer, kl_ctrl: Any, tokenizer: Any,
                 end_metrics: StepEndMetrics, *, rank: int, off_policy: bool, dry_run: bool, dp_size: int,
                 balance_block: int, reward_swap: RewardModelSwap | None = None):
        """``off_policy``: the batch source trains on older weights' rollouts (the off-policy diagnostics logged,
        the on-policy shortcut never taken); ``dp_size`` / ``balance_block``: the actor's DP size and the rows
        balancing may reorder within (:func:`~verl.trainer.ppo.data.balance_layout`); ``reward_swap``: the reward
        model's hot swap, checked before each step's rewards."""
        self.sections, self.roles, self.timer, self.kl_ctrl = sections, roles, timer, kl_ctrl
        self.tokenizer, self.end_metrics, self.reward_swap = tokenizer, end_metrics, reward_swap
        self.rank, self.off_policy, self.dry_run = rank, off_policy, dry_run
        self.dp_size, self.balance_block = dp_size, balance_block
        self.use_critic = use_critic(sections)
        self.use_reference = use_reference(sections)
        self.use_rm = sections.reward_model.enable
        self.bypass_old_log_prob = sections.algorithm.rollout_correction.bypass_mode
        self._reward_pool_instance = None

    def run(self, source: Any, step_input: Any, step: int) -> dict[str, float]:
        """Step ``step`` from ``step_input`` (what ``source`` handed the loop: the dataloader's batch for the sync
        source): the source's generated batch(es), each learnt from; returns the step's metrics."""
        trained = []
        with self.frame(step) as metrics:
            for generated in source.generate(step_input, step, metrics):
                batch = self.learn(generated.batch, generated.metrics, step)
                source.trained(generated, batch)
                trained.append((generated, batch))
            batch, on_policy = source.end_step(step, metrics, trained)
        return self.end_metrics(batch, metrics, on_policy)

    @contextlib.contextmanager
    def frame(self, step: int) -> Iterator[dict[str, float]]:
        """A step's frame, the same in every trainer mode: fresh timings and data-plane counters, the whole step
        timed as ``timing_s/step``, a due reward-model swap first; yields the step's metrics dict."""
        metrics: dict[str, float] = {}
        self.timer.reset()
        data_plane.STATS.reset()
        with self.timer("step"):
            if self.reward_swap is not None:
                metrics.update(self.reward_swap.maybe_swap(step))
            yield metrics

    def prompt_batch(self, batch_dict: dict[str, Any], step: int, validate: bool) -> DataProto:
        """A dataloader batch as the rollout's prompts: ``uid`` per row (unique in the run), the step's sampling
        seed, and the tokenizer's EOS / pad ids."""
        batch = DataProto.from_single_dict(batch_dict)
        batch.non_tensor_batch["uid"] = np.array([f"{step}-{i}" for i in range(len(batch))], dtype=object)
        gen = DataProto.from_dict({k: batch.batch[k] for k in PROMPT_FIELDS}, dict(batch.non_tensor_batch))
        gen.meta_info = {"seed": self.sections.trainer.seed * 100003 + step, "validate": validate,
                         "eos_token_id": self.tokenizer.eos_token_id, "pad_token_id": self.tokenizer.pad_token_id}
        return gen

    def generate(self, gen: DataProto, step: int, metrics: dict[str, float]):
        """The prompts ``gen`` generated on the current weights (verl's sync mode): the weights resharded into
        the rollout, one sampled batch; ReMax adds each prompt's greedy baseline reward."""
        cfg = self.sections
        with self.timer("update_weights"):
            metrics.update(self.roles.actor_rollout_wg.update_weights())
        with self.timer("gen"):
            batch = self.roles.actor_rollout_wg.generate_sequences(self.on_data_plane(gen, step))
        metrics.update(metric_utils.reduce_metrics(batch.meta_info.pop("metrics")))
        batch.meta_info = {"seed": step}
        if cfg.algorithm.adv_estimator == core_algos.AdvantageEstimator.REMAX.value:
            with self.timer("update_weights"):  # generation released the rollout weights
                self.roles.actor_rollout_wg.update_weights()
            with self.timer("gen_max"):
                baselines = self._greedy_baseline_rewards(gen).repeat_interleave(cfg.actor_rollout_ref.rollout.n)
                batch_ops.add_replicated(batch, {"reward_baselines": baselines})
        return batch

    def learn(self, batch, metrics: dict[str, float], step: int):
        """A generated batch -> rewards, old/ref log-probs, values, advantages, critic and actor updates (the
        step after generation, the same for every batch source)."""
        return self.update_models(self.experience(batch, metrics, step), metrics, step)

    def experience(self, batch, metrics: dict[str, float], step: int):
        """A generated batch -> rewards, old/ref log-probs, values and advantages (no weight changes)."""
        cfg = self.sections
        if cfg.trainer.balance_batch:
            # Rows move between DP ranks only within the mini-batches' slices (see balance_layout), and
            # the group estimators find groups by uid, not by position: the same step, reordered.
            metrics.update(self._balance_batch(batch))

        with self.timer("reward"):
            if self.use_rm:
                scored = self.roles.rm_wg.compute_rm_score(batch)
                # reward_model/truncated_frac of an RM with its own tokenizer
                metrics.update(metric_utils.reduce_metrics(scored.meta_info.pop("metrics", None) or {}))
                batch.union(scored)
            pending_rewards = self._start_rewards(batch)
        if self.bypass_old_log_prob:
            # verl's rollout_correction.bypass_mode: the rollout's log-probs (same weights, same
            # temperature) are the old policy's; no separate forward, and no actor/entropy metric.
            fields = batch.keys() if isinstance(batch, ShardedBatch) else batch.batch.keys()
            if "rollout_log_probs" not in fields:  # an agent loop that returned none: never zeros
                raise RolloutLogProbsMissing(
                    "algorithm.rollout_correction.bypass_mode=true: expected the rollout's log-probs "
                    "(rollout_log_probs) as the old policy's, found a batch without them (an agent loop that "
                    "returns no AgentLoopOutput.response_logprobs): return them, or set bypass_mode=false to "
                    "recompute them")
            batch_ops.add_fields(batch, lambda rows: {"old_log_probs": rows.batch["rollout_log_probs"]},
                                 ["rollout_log_probs"], anchor="rollout_log_probs")
        elif self._old_log_probs_from_update(batch, step):
            # Exactly on-policy: the update's forward gives the old log-probs (and actor/entropy) after the fact.
            batch.meta_info["return_old_log_probs"] = True
        else:
            with self.timer("old_log_prob"):
                old = self.roles.actor_rollout_wg.compute_log_prob(batch)
                batch.union(old)
                metrics["actor/entropy"] = batch_ops.aggregate_rows(batch, "entropys",
                                                                    cfg.actor_rollout_ref.actor.loss_agg_mode)
                batch_ops.pop_fields(batch, ["entropys"])
            metrics.update(self._rollout_correction(batch))
        if self.use_reference:
            with self.timer("ref"):
                batch.union(self.roles.actor_rollout_wg.compute_ref_log_prob(batch))
        if self.use_critic:
            with self.timer("values"):
                batch.union(self.roles.critic_wg.compute_values(batch))
        if pending_rewards is not None:
            with self.timer("reward"):  # what of the pool's work the passes above did not hide
                self._finish_rewards(batch, *pending_rewards)
        with self.timer("adv"):
            if cfg.algorithm.use_kl_in_reward:
                metrics.update(self._apply_kl_penalty(batch))
            else:
                batch_ops.add_fields(batch, lambda rows: {"token_level_rewards": rows.batch["token_level_scores"]},
                                     ["token_level_scores"], anchor="token_level_scores")
            batch = batch_ops.compute_advantages(
                batch, cfg.algorithm.adv_estimator, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                num_repeat=cfg.actor_rollout_ref.rollout.n,
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo)
        return batch

    def update_models(self, batch, metrics: dict[str, float], step: int):
        """The step's updates on a batch with advantages: critic, then actor (once ``critic_warmup`` allows), and
        the generation dump."""
        cfg = self.sections
        if not self.dry_run:
            if self.use_critic:
                with self.timer("update_critic"):
                    metrics.update(metric_utils.reduce_metrics(
                        self.roles.critic_wg.update_critic(batch).meta_info["metrics"]))
            # verl: the actor trains once critic_warmup <= the step (steps count from 1).
            if cfg.trainer.critic_warmup <= step:
                with self.timer("update_actor"):
                    out = self.roles.actor_rollout_wg.update_actor(batch)
                    metrics.update(metric_utils.reduce_metrics(out.meta_info.pop("metrics")))
                if batch.meta_info.pop("return_old_log_probs", False):
                    batch.union(out)  # old_log_probs and entropys, on either data path
                    metrics["actor/entropy"] = batch_ops.aggregate_rows(batch, "entropys",
                                                                        cfg.actor_rollout_ref.actor.loss_agg_mode)
                    batch_ops.pop_fields(batch, ["entropys"])
        if cfg.trainer.rollout_data_dir:
            with self.timer("dump_rollout_generations"):
                self._dump_generations(batch, step)
        return batch

    def _old_log_probs_from_update(self, batch, step: int) -> bool:
        """Whether this step's old log-probs come from the actor update's own forward (TRL's on-policy shortcut,
        ``actor.recompute_on_policy_old_log_prob=false``): only where that is exact -- the update is one epoch over
        one mini-batch on the weights that generated the batch (the sync trainer), runs this step, and nothing
        reads the old log-probs before it (no rollout correction, no KL in the reward)."""
        cfg = self.sections
        actor, rc = cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
        return (not actor.recompute_on_policy_old_log_prob and not self.off_policy and not self.dry_run
                and actor.ppo_epochs == 1
                and len(batch) <= actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
                and rc.rollout_is is None and rc.rollout_rs is None and not cfg.algorithm.use_kl_in_reward
                and cfg.trainer.critic_warmup <= step)

    # ------------------------------------------------------------------ the step's glue
    def _start_rewards(self, batch):
        """``token_level_scores`` added to ``batch`` now, or, with ``reward.num_workers`` (no reward model), the
        rows sent to the reward pool: returns what :meth:`_finish_rewards` collects before the advantage."""
        pool = None if self.use_rm else self._reward_pool()
        if pool is None:
            from verl.workers.reward_manager.naive import check_finite_scores

            # any reward manager's scores: a NaN or inf would reach every advantage of its group
            reward_fn = self.roles.reward_fn
            batch_ops.add_fields(batch, lambda rows: {"token_level_scores": check_finite_scores(reward_fn(rows))},
                                 batch.keys() if isinstance(batch, ShardedBatch) else ())
            return None
        if isinstance(batch, ShardedBatch):  # the rows this rank holds, as map_rows would score them
            positions, rows = batch.local_rows(batch_ops.ANCHOR, batch.keys())
            return (pool.submit(rows, positions) if len(positions) else None,
                    batch.holder(batch_ops.ANCHOR).owner)
        return pool.submit(rows=batch), None

    def _finish_rewards(self, batch, pending, owner) -> None:
        result = {"token_level_scores": pending.result()} if pending is not None else {}
        if isinstance(batch, ShardedBatch):
            batch.union(batch.from_local_results(owner, result))
        else:
            batch.batch.update(result)

    def _reward_pool(self):
        """The reward pool of ``reward.num_workers`` processes (None: rewards in the step), started on first use
        and again if ``reward_fn`` was replaced (the Python API's DataFlow sets its own)."""
        workers = self.sections.reward.num_workers or 0
        if not workers:
            return None
        from verl.workers.reward_manager.async_pool import RewardPool

        pool = self._reward_pool_instance
        if pool is None or pool.reward_fn is not self.roles.reward_fn:
            if pool is not None:
                pool.close()
            pool = self._reward_pool_instance = RewardPool(self.roles.reward_fn, workers,
                                                           timeout_s=self.sections.reward.timeout_s)
        return pool

    def on_data_plane(self, gen: DataProto, step: int = 0) -> DataProto | ShardedBatch:
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
        inputs = ["token_level_scores", "old_log_probs", "ref_log_prob", "responses", "attention_mask", "response_mask"]

        def rewards(rows: DataProto) -> dict[str, torch.Tensor]:
            # response_mask as the legacy path (apply_kl_penalty): multi-turn tool tokens carry no KL
            mask = rows.batch["response_mask"] if "response_mask" in rows.batch.keys() else compute_response_mask(rows)
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

    def _dump_generations(self, batch, step: int) -> None:
        """trainer.rollout_data_dir: the step's generations on rank 0 (rewards recomputed there for their
        extra info on the data plane, where no rank holds the whole batch)."""
        rows = batch_ops.gather_to_rank0(batch)
        if self.rank != 0 or rows is None:
            return
        reward = self.roles.reward_fn(rows, return_dict=True)
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
        baseline = self.roles.actor_rollout_wg.generate_sequences(self.on_data_plane(baseline_gen))
        baseline.meta_info.pop("metrics", None)
        if self.use_rm:
            scored = self.roles.rm_wg.compute_rm_score(baseline)
            scored.meta_info.pop("metrics", None)
            baseline.union(scored)
        return self.sequence_rewards(baseline)

    def sequence_rewards(self, batch) -> torch.Tensor:
        """[B] sequence rewards of generated rows, on every rank (computed where the rows are)."""
        inputs = batch.keys() if isinstance(batch, ShardedBatch) else ()
        return batch_ops.per_row(batch, lambda rows: self.roles.reward_fn(rows).sum(-1), inputs)
