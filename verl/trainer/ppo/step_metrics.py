"""A PPO step's closing metrics: the batch's (``critic/*``, ``response_length/*``...), timings, ``perf/mfu/*``,
memory, the data plane's (``perf/data_plane_*``), the first on-policy step's weight-sync check, and the
``trainer.debug`` sample lines."""

from __future__ import annotations

import os
from typing import Any

from verl.protocol import DataProto
from verl.single_controller import all_gather_objects, data_plane
from verl.single_controller.data_plane import ShardedBatch
from verl.trainer import metrics as metric_utils
from verl.trainer.config import use_critic
from verl.trainer.ppo import batch_ops
from verl.trainer.ppo.context import PhaseTimer, Roles


class StepEndMetrics:
    """A PPO step's closing metrics (see the module doc); ``end_metrics(batch, metrics, on_policy)`` adds them to
    ``metrics``. Built once by the trainer with what they read: the timer's phases, the models' shapes and this
    device's promised FLOP/s (``peak_flops``; None on CPU: no ``perf/mfu/*``), the roles whose memory is reported."""

    def __init__(self, sections: Any, roles: Roles, timer: PhaseTimer, tokenizer: Any, *, world_size: int,
                 peak_flops: float | None, actor_model_config: Any, critic_model_config: Any = None):
        self.sections, self.roles, self.timer, self.tokenizer = sections, roles, timer, tokenizer
        self.world_size, self.peak_flops = world_size, peak_flops
        self.actor_model_config, self.critic_model_config = actor_model_config, critic_model_config
        self.use_critic = use_critic(sections)
        self.bypass_old_log_prob = sections.algorithm.rollout_correction.bypass_mode
        self.debug = sections.trainer.debug
        # The weight-sync check runs once a process, on its first batch that the live weights generated.
        self.probs_checked = False

    def check_rollout_probs_once(self, metrics: dict[str, float]) -> None:
        """The first on-policy batch's ``training/rollout_probs_diff_*`` (in ``metrics``) against the bound of the
        rollout's dtype: a broken weight sync fails loudly at the first step; later calls do nothing."""
        if not self.probs_checked:
            metric_utils.check_rollout_probs_diff(metrics, self.sections.actor_rollout_ref.rollout.dtype)
            self.probs_checked = True

    def __call__(self, batch, metrics: dict[str, float], on_policy: bool = True) -> dict[str, float]:
        """The step's batch, timing, memory and data-plane metrics; the first step of a process whose batch the
        live weights generated (``on_policy``) checks the rollout's log-probs against the actor's."""
        metrics.update(batch_ops.step_metrics(batch, self.use_critic, self.timer.timing, self.world_size, self._mfu,
                                              self.bypass_old_log_prob))
        if on_policy:
            self.check_rollout_probs_once(metrics)
        from verl.workers.reward_model.role_memory import local_role_memory  # memory/<model>_gb

        metrics.update(metric_utils.reduce_memory_metrics(all_gather_objects(
            {**metric_utils.local_memory_metrics(), **local_role_memory(self.roles)})))
        # The legacy path's figures too when asked (`verl bench dispatch --legacy`): they cost a gather.
        if isinstance(batch, ShardedBatch) or os.environ.get("VERL_DATA_PLANE_STATS") == "1":
            metrics.update(self._data_plane_metrics())
        if self.debug:
            rows = batch_ops.gather_to_rank0(batch)
            if rows is not None:
                self._debug_print(rows, metrics)
        return metrics

    def _mfu(self, seqlens) -> dict[str, float]:
        """perf/mfu/* from ``seqlens()`` (every row's valid tokens), asked for only with a known peak."""
        cfg = self.sections
        if self.peak_flops is None:
            return {}
        return metric_utils.compute_mfu_metrics(
            seqlens(), self.timer.timing, self.world_size, self.peak_flops, self.actor_model_config,
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
            self.timer.say(line)
        if self.debug == "full":
            losses = {k: round(v, 5) for k, v in metrics.items() if k.endswith("_loss") or k.endswith("loss/mean")}
            self.timer.say(f"[debug] losses {losses}")
