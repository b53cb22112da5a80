"""verl's V1 ``separate_async`` trainer: the rollout runs on a standalone pool (``rollout.nnodes > 0``) and never
stops generating; training takes prompt groups from the replay buffer as soon as a mini-batch of them is
finished, and the weights go to the pool every ``parameter_sync_step`` mini-batch updates.

A step ``G`` (one weight sync, as in verl; ``train_batch_size = parameter_sync_step x ppo_mini_batch_size``):

1. training rank 0 submits one more train batch of prompts to the pool (``num_warmup_batches`` more before
   step 1); each pool replica keeps its groups in flight and generates in segments, streaming finished groups
   back (:func:`verl.workers.rollout_pool._serve_stream`);
2. ``parameter_sync_step`` times: rank 0 waits until ``ppo_mini_batch_size`` groups are trainable (the time is
   ``timing_s/gen``, the trainer's wait), samples the oldest, and every training rank runs the sync trainer's
   update on them (:meth:`PPOStep.learn <verl.trainer.ppo.step.PPOStep.learn>`: one optimizer step per mini-batch);
3. the weights go to the pool (version ``G``): the segment running there ends, its unfinished responses keep
   their tokens and continue on the new weights (partial rollout).

Training rank 0 holds the replay buffer; the other training ranks receive each sampled mini-batch from it.
The old log-probs of a mini-batch are the actor's just before its update (decoupled PPO: the policy loss's
ratio is against them, ``algorithm.rollout_correction`` corrects between them and the rollout's).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from verl.engine.rollout.partial import PromptGroup, groups_to_batch
from verl.protocol import DataProto
from verl.single_controller import broadcast_object
from verl.single_controller.data_plane import ShardedBatch
from verl.single_controller.generation_wait import GenerationTimeoutError
from verl.trainer import metrics as metric_utils
from verl.trainer.ppo.batch_source import Generated, SourceContext
from verl.trainer.ppo.trainer import PPOTrainer
from verl.trainer.v1.colocate_async import ReplayBufferSource, off_policy_metrics
from verl.utils.timeline import pool_lane
from verl.workers.agent_stream import agent_metrics

# Summed over a step's mini-batches (verl's MetricsAggregator sums these counts); the rest are averaged.
SUMMED = ("training/off_policy/evicted_samples", "rollout/segment_rows", "rollout/busy_s",
          "agent_loop/finished_trajectories")


class PoolSource(ReplayBufferSource):
    """The standalone pool's stream as the trainer's batch source (see the module doc): training rank 0 holds the
    replay buffer and hands each step ``parameter_sync_step`` mini-batches; the weights go to the pool after
    them."""

    buffer_replicated = False  # training rank 0 holds the buffer
    agent_phases_class = None  # the agent loops run on the pool (verl.workers.agent_stream.serve_pool_agents)

    def __init__(self, ctx: SourceContext):
        super().__init__(ctx)
        cfg = ctx.sections
        self.mini_groups = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        self.sync_steps = cfg.trainer.v1.separate_async.parameter_sync_step
        self.pool = ctx.roles.actor_rollout_wg.worker.rollout_side.stream

    @staticmethod
    def _warmup_batches(v1: Any) -> int:
        return v1.separate_async.num_warmup_batches

    def _start_generation(self, global_step: int) -> None:
        """Weights of the current version to the pool, then streaming generation (rank 0 drives it)."""
        ctx = self.ctx
        ctx.roles.actor_rollout_wg.update_weights(version=global_step, force=True)
        if ctx.rank == 0:
            replicas = self.pool.placement.replicas
            worker = ctx.roles.actor_rollout_wg.worker
            self.pool.start_stream(worker.train_sampling, max(1, -(-self.mini_groups // replicas)),
                                   ctx.sections.trainer.seed * 100003 + global_step, global_step)
            self.pool.submit(list(self.buffer.in_flight.values()))  # reissued after a resume, or nothing

    def _submit(self, count: int, step: int) -> None:
        """Training rank 0 draws the prompts and hands them to the pool."""
        if self.ctx.rank == 0:
            self.pool.submit(self.buffer.submit(count, step))

    def generate(self, step_input: Any, step: int, metrics: dict[str, float]) -> Iterator[Generated]:
        ctx = self.ctx
        self._submit(self.batch_groups, step)
        for index in range(self.sync_steps):
            mini: dict[str, float] = {}
            with ctx.timer("gen"):  # the trainer's wait for a mini-batch of finished groups
                groups, waited = self._sample(step, mini)
                # The others wait for rank 0 here, up to the rollout's deadline (not the collective timeout).
                ctx.roles.actor_rollout_wg.generation_wait.wait("separate_async: a mini-batch from the pool")
            batch, extra = broadcast_object(self._mini_batch(groups, step) if ctx.rank == 0 else None)
            # Only the step's first mini-batch meets the actor that generated it (the next ones' old
            # log-probs come from its snapshot, but the check reads the first): the weight-sync check.
            on_policy = extra.pop("_on_policy") and index == 0
            mini.update(extra)
            if index:  # pi_old is the cycle's first actor for every mini-batch of it (verl's local trigger)
                batch.meta_info["old_policy"] = True
            else:
                ctx.roles.actor_rollout_wg.snapshot_old_policy()
            if ctx.sections.transfer_queue.enable:  # row ids unique per mini-batch of the step
                batch = ShardedBatch.replicated(batch, first_id=(step << 32) + index * len(batch))
            yield Generated(batch, mini, on_policy, info=groups)

    def trained(self, generated: Generated, batch: Any) -> None:
        if generated.on_policy and isinstance(batch, DataProto):
            self.ctx.end_metrics.check_rollout_probs_once(metric_utils.compute_rollout_probs_diff_metrics(batch))

    def end_step(self, step: int, metrics: dict[str, float], trained: list) -> tuple[Any, bool]:
        ctx = self.ctx
        with ctx.timer("update_weights"):  # version G to the pool; its running segment resumes on it
            metrics.update(ctx.roles.actor_rollout_wg.update_weights(version=step))
        metrics.update(_merge([generated.metrics for generated, _ in trained]))
        if ctx.rank == 0:
            self._record(step, [group for generated, _ in trained for group in generated.info])
            self.buffer.end_step()
        batches = [batch for _, batch in trained]
        # Later mini-batches met newer actors than generated them: the step's batch is not checked.
        return (DataProto.concat(batches) if isinstance(batches[0], DataProto) else batches[-1]), False

    def _sample(self, step: int, metrics: dict[str, float]) -> tuple[list[PromptGroup], float]:
        """Training rank 0: wait for a mini-batch of trainable groups (evicting stale ones and drawing their
        replacements, as verl's ReplayBufferAsync), then take the oldest."""
        if self.ctx.rank != 0:
            return [], 0.0
        start = time.perf_counter()
        timeout = float(self.ctx.sections.actor_rollout_ref.rollout.generation_timeout)
        deadline = start + timeout
        segment_metrics: list[dict[str, float]] = []
        while True:
            for message in self.pool.poll(timeout=0):
                self._receive(message, segment_metrics)
            _, refills = self.buffer.evict_stale(step)
            if refills:
                self.pool.submit(refills)
            if self.buffer.ready(self.mini_groups, step):
                break
            remaining = deadline - time.perf_counter()
            messages = self.pool.poll(timeout=max(remaining, 0.0))
            if not messages and time.perf_counter() >= deadline:
                raise GenerationTimeoutError(
                    f"rollout pool: {len(self.buffer.finished)} of the {self.mini_groups} groups a mini-batch needs "
                    f"had finished after actor_rollout_ref.rollout.generation_timeout={timeout:g} s, with "
                    f"{len(self.buffer.in_flight)} in flight; raise it for longer rollouts")
            for message in messages:
                self._receive(message, segment_metrics)
        groups = self.buffer.sample(self.mini_groups, step)
        metrics.update(self.buffer.eviction_metrics())
        if segment_metrics:
            for key in ("rollout/segment_rows", "agent_loop/finished_trajectories"):
                metrics[key] = sum(m.get(key, 0.0) for m in segment_metrics)
            # The pool's generating seconds (each replica's segments; replicas run side by side: the busiest).
            busy: dict[int, float] = {}
            for m in segment_metrics:
                busy[m["replica"]] = busy.get(m["replica"], 0.0) + m.get("timing_s/generate_segment", 0.0)
            metrics["rollout/busy_s"] = max(busy.values())
        metrics["rollout/in_flight_groups"] = float(len(self.buffer.in_flight))
        return groups, time.perf_counter() - start

    def _receive(self, message: dict, segment_metrics: list[dict[str, float]]) -> None:
        """A replica's finished groups replace their in-flight entries (the pool generated into copies)."""
        if message.get("error"):
            raise RuntimeError(f"rollout pool replica {message['replica']}: {message['error']}")
        for group in message.get("groups", ()):
            if group.uid in self.buffer.in_flight:
                self.buffer.in_flight[group.uid] = group
        if message.get("span") and self.ctx.timer.timeline is not None:
            self.ctx.timer.timeline.add(pool_lane(message["replica"]), *message["span"])
        if message.get("metrics"):
            segment_metrics.append({**message["metrics"], "replica": message["replica"]})
        self.buffer.collect_finished()

    def _mini_batch(self, groups: list[PromptGroup], step: int) -> tuple[Any, dict[str, Any]]:
        extra: dict[str, Any] = dict(off_policy_metrics(groups, step))
        extra["training/epoch"] = float(min(g.epoch for g in groups))
        extra["_on_policy"] = all(t.min_version == step - 1 for g in groups for t in g.trajectories)
        if self.multi_turn:
            extra.update(agent_metrics(groups))
        data = self.ctx.sections.data
        tensors, fields = groups_to_batch(groups, data.max_prompt_length, data.max_response_length, self.pad)
        return DataProto.from_dict(tensors, fields, {"seed": step}), extra


class SeparateAsyncTrainer(PPOTrainer):
    """``trainer.v1.trainer_mode=separate_async`` (see the module doc): the PPO trainer over a rollout pool."""

    batch_source_class = PoolSource


def _merge(per_mini: list[dict[str, float]]) -> dict[str, float]:
    """A step's metrics from its mini-batches' (verl's MetricsAggregator: counts summed, the rest averaged)."""
    keys = set().union(*per_mini) if per_mini else set()
    out = {}
    for key in keys:
        values = [m[key] for m in per_mini if key in m]
        if key.endswith(("/max",)):
            out[key] = float(max(values))
        elif key.endswith(("/min",)):
            out[key] = float(min(values))
        elif key in SUMMED:
            out[key] = float(sum(values))
        else:
            out[key] = float(np.mean(values))
    return out
