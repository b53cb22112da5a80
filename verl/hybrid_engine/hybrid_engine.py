"""The 3D-HybridEngine in a training loop: binds the actor's Megatron weights to one flat training
buffer, plans the reshard once, and moves weights into the rollout engine's buffer before generation
(``to_rollout``) and releases the rollout memory after it (``to_training``).

The rollout engine is any object with ``resume()``, ``weight_buffer()``, ``push_weights()`` and
``release()`` (the native engine and the trainer's SGLang rollout); the actor engine is a
``MegatronEngine`` (``module``, ``model``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.hybrid_engine.executor import ReshardExecutor, ReshardProcessGroups, offsets_from_views
from verl.hybrid_engine.groups import ReshardGroups, derive_groups
from verl.hybrid_engine.layouts import TrainingLayout, training_param_specs
from verl.hybrid_engine.planner import plan_reshard
from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs
from verl.models.config import ModelConfig

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
    """Reshards the actor's Megatron weights into the rollout engine's flat buffer and back out of it.

    The actor's parameters are rebound (once) to views of one flat training buffer in
    ``training_param_specs`` order unless Megatron's distributed optimizer already keeps them in
    one buffer; the executor's copy programs address both buffers by offset.
    """

    def __init__(self, actor_engine: Any, rollout: Any, model_config: ModelConfig, training: TrainingLayout,
                 rollout_tp: int, bucket_bytes: int, dtype: str):
        from megatron.core import parallel_state as mpu

        rank = dist.get_rank()
        self.rollout = rollout
        self.groups = derive_groups(training, rollout_tp)
        flat, offsets = self._bind_training_buffer(actor_engine, model_config, training, mpu)
        plan = plan_reshard(model_config, training, RolloutLayout(rollout_tp), rank, bucket_bytes, dtype)
        j = self.groups.rollout_tp_rank[rank]
        specs = [(s.name, s.shape) for s in rollout_param_specs(model_config, rollout_tp, j)]
        self.executor = ReshardExecutor(plan, flat, offsets, specs, ReshardProcessGroups(self.groups))
        self.summary = plan.summary()

    @staticmethod
    def _bind_training_buffer(engine: Any, model_config: ModelConfig, training: TrainingLayout, mpu):
        params = dict(engine.module.named_parameters())
        buffers = getattr(engine.model, "buffers", None) or []
        param_data = [b.param_data for b in buffers if getattr(b, "param_data", None) is not None]
        if len(param_data) == 1:  # distributed optimizer: parameters already live in one buffer
            return param_data[0], offsets_from_views(param_data[0], params)
        specs = training_param_specs(model_config, training.tp, training.pp,
                                     mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank())
        missing = [name for name, _ in specs if name not in params]
        if missing:
            raise KeyError(f"hybrid engine: expected Megatron parameters {missing[:3]}, found {sorted(params)[:6]}...")
        total = sum(int(np.prod(shape)) for _, shape in specs)
        first = params[specs[0][0]]
        flat = torch.empty(total, dtype=first.dtype, device=first.device)
        offsets, offset = {}, 0
        with torch.no_grad():
            for name, shape in specs:
                numel = int(np.prod(shape))
                view = flat[offset:offset + numel].view(params[name].shape)
                view.copy_(params[name].data)
                params[name].data = view  # the optimizer and DDP keep the Parameter object
                offsets[name] = offset
                offset += numel
        return flat, offsets

    def to_rollout(self) -> dict[str, float]:
        """Training -> rollout layout, straight into the rollout engine's weights (the native engine) or
        into the buffer the engine is then handed (SGLang: ``push_weights``, timed on its own)."""
        self.rollout.resume()
        stats = self.executor.to_rollout(into=self.rollout.weight_buffer())
        metrics = stats.metrics()
        pushed = self.rollout.push_weights()
        if pushed:
            # The weight sync has two parts now (verl's timing_s/update_weights is both): without a push the
            # reshard is the whole of it and gets no name of its own.
            metrics[METRIC_RESHARD_SECONDS] = stats.seconds
            self.executor.release()  # the engine copied the weights: the executor need not hold the buffer
        return {**metrics, **pushed}

    def to_training(self) -> None:
        """Release the rollout weights and KV cache; the training weights were never moved."""
        self.executor.release()
        self.rollout.release()


