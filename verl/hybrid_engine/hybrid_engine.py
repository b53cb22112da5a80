"""The 3D-HybridEngine in a training loop: plans the reshard once, moves the actor's weights into
the rollout engine's buffer before generation (``to_rollout``) and releases the rollout memory after
it (``to_training``).

The rollout engine is any :class:`~verl.engine.rollout.base.BaseRollout` (``resume()``, ``weight_buffer()``,
``push_weights()``, ``release()``). The actor engine's weights are read as :func:`~verl.hybrid_engine.weight_source.
actor_weights` chooses (the training-engine contract; each backend's half lives in its own ``verl/engine/<backend>/``):
one flat buffer its weights are views of, bound once, or its local shards by name at every transition.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch.distributed as dist

from verl.hybrid_engine.executor import METRIC_BYTES, ReshardExecutor, ReshardProcessGroups
from verl.hybrid_engine.groups import ReshardGroups, derive_groups
from verl.hybrid_engine.layouts import AnyTrainingLayout, LayoutError
from verl.hybrid_engine.lora_sync import METRIC_ADAPTER_BYTES, METRIC_BASE_BYTES, ColocatedLoRASync
from verl.hybrid_engine.planner import plan_reshard
from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs
from verl.hybrid_engine.weight_source import actor_weights
from verl.models.config import ModelConfig
from verl.utils.torch_dtypes import torch_dtype

# The executor's part of verl's timing_s/update_weights, logged when a push to the engine follows it (SGLang).
METRIC_RESHARD_SECONDS = "timing_s/reshard"


def rollout_tp_process_group(groups: ReshardGroups, rank: int, backend: str | None = None):
    """``(rollout DP index, ranks, process group)`` of ``rank``'s rollout TP group; the group is None when it is
    one rank. Every rank creates every group, in the same order, as ``dist.new_group`` requires."""
    mine = None
    for index, ranks in enumerate(groups.rollout_tp_groups):
        group = dist.new_group(list(ranks), backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = (index, ranks, group)
    return mine


class HybridEngine:
    """Reshards the actor's weights into the rollout engine's flat buffer and back out of it.

    The actor engine either binds its weights to one flat training buffer (``bind_reshard`` returns it:
    Megatron's distributed-optimizer buffer, or one it rebinds the parameters into), whose elements the
    executor's copy programs address by offset; or it hands its local shards by name at every transition
    (``bind_reshard`` returns None: FSDP2's shards, Megatron's when dense and expert parameters live in
    separate buffers), cast and moved to the rollout buffer's dtype and device only when they differ. The
    executor is then bound at the first transition, when that buffer is known.
    """

    def __init__(self, actor_engine: Any, rollout: Any, model_config: ModelConfig, training: AnyTrainingLayout,
                 rollout_tp: int, bucket_bytes: int, dtype: str, groups: ReshardGroups | None = None):
        rank = dist.get_rank()
        self.rollout = rollout
        self.groups = groups if groups is not None else derive_groups(training, rollout_tp)
        plan = plan_reshard(model_config, training, RolloutLayout(rollout_tp), rank, bucket_bytes, dtype)
        j = self.groups.rollout_tp_rank[rank]
        specs = [(s.name, s.shape) for s in rollout_param_specs(model_config, rollout_tp, j)]
        process_groups = ReshardProcessGroups(self.groups)
        self.summary = plan.summary()
        self.executor: ReshardExecutor | None = None
        # Set when the training tensors are handed to every transition by name (not one flat buffer).
        self._sources_of: Any = None
        self._dtype = torch_dtype(dtype)
        self._bind = (plan, specs, process_groups)
        weights = actor_weights(actor_engine, model_config, training)
        # LoRA with lora.merge=false: the base once, then the adapters alone (lora_sync).
        self.lora: ColocatedLoRASync | None = None
        if weights.lora is not None:
            self.lora = ColocatedLoRASync(weights.lora, model_config, rollout_tp, bucket_bytes, self.groups,
                                          process_groups)
            self.summary += "\n" + self.lora.plan.summary()
        if weights.named is not None:
            self._sources_of = lambda into: weights.named(into.dtype, into.device)
        else:
            flat, offsets = weights.bound
            self.executor = ReshardExecutor(plan, flat, offsets, specs, process_groups)

    def to_rollout(self) -> dict[str, float]:
        """Training -> rollout layout, straight into the rollout engine's weights (the native engine) or
        into the buffer the engine is then handed (SGLang: ``push_weights``, timed on its own)."""
        self.rollout.resume()
        into = self.rollout.weight_buffer()
        if self.lora is not None and self.lora.has_base:
            # Adapters only: merged into the rollout shard from the base kept at the first sync.
            metrics = self.lora.sync(into, restore=True)
            seconds = metrics.pop("_seconds")
            metrics[METRIC_BYTES] = metrics[METRIC_ADAPTER_BYTES]
            pushed = self.rollout.push_weights()
            if pushed:
                metrics[METRIC_RESHARD_SECONDS] = seconds
            return {**metrics, **pushed}
        if self._sources_of is None:
            stats = self.executor.to_rollout(into=into)
        else:
            if into.dtype != self._dtype:
                raise LayoutError(f"hybrid engine: expected the rollout buffer in {self._dtype}, found {into.dtype}")
            fetch = time.perf_counter()
            sources = self._sources_of(into)
            fetch = time.perf_counter() - fetch
            if self.executor is None:
                self.executor = ReshardExecutor(self._bind[0], sources, None, self._bind[1], self._bind[2])
            stats = self.executor.to_rollout(into=into, sources=sources)
            del sources  # casts made for this transition only
            # A cast is part of the transition's copies.
            stats = dataclasses.replace(stats, seconds=stats.seconds + fetch, copy_seconds=stats.copy_seconds + fetch)
        metrics = stats.metrics()
        if self.lora is not None:  # the first sync: the base just arrived; keep it, merge the adapters in
            self.lora.capture_base(into)
            lora = self.lora.sync(into, restore=False)
            stats = dataclasses.replace(stats, seconds=stats.seconds + lora.pop("_seconds"))
            metrics.update(lora)
            metrics[METRIC_BASE_BYTES] = metrics[METRIC_BYTES]
            metrics[METRIC_BYTES] += lora[METRIC_ADAPTER_BYTES]
        pushed = self.rollout.push_weights()
        if pushed:
            # The weight sync has two parts now (verl's timing_s/update_weights is both): without a push the
            # reshard is the whole of it and gets no name of its own.
            metrics[METRIC_RESHARD_SECONDS] = stats.seconds
            self.executor.release()  # the engine copied the weights: the executor need not hold the buffer
        return {**metrics, **pushed}

    def to_training(self) -> None:
        """Release the rollout weights and KV cache; the training weights were never moved."""
        if self.executor is not None:
            self.executor.release()
        if self.lora is not None:
            self.lora.release()
        self.rollout.release()


