"""The 3D-HybridEngine in a training loop: plans the reshard once, moves the actor's weights into
the rollout engine's buffer before generation (``to_rollout``) and releases the rollout memory after
it (``to_training``).

The rollout engine is any object with ``resume()``, ``weight_buffer()``, ``push_weights()`` and
``release()`` (the native engine and the trainer's SGLang rollout). The actor engine is a
``MegatronEngine`` (``module``, ``model``; its weights are bound to one flat training buffer) for a
:class:`TrainingLayout`, or any engine whose ``module`` is a ``fully_shard``-ed transformers CausalLM
for an :class:`FSDPLayout` (its parameters' local shards are read where they are, see
:func:`fsdp_reshard_sources`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.hybrid_engine.executor import ReshardExecutor, ReshardProcessGroups, offsets_from_views
from verl.hybrid_engine.groups import ReshardGroups, derive_groups
from verl.hybrid_engine.layouts import (
    AnyTrainingLayout,
    FSDPLayout,
    LayoutError,
    TrainingLayout,
    hf_tensor_shapes,
    local_shape,
    training_param_specs,
)
from verl.hybrid_engine.planner import plan_reshard
from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs
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


def fsdp_reshard_sources(module: torch.nn.Module, dtype: torch.dtype, device: torch.device | str
                         ) -> dict[str, torch.Tensor]:
    """``{parameter name: this rank's local shard, 1-D}`` of a ``fully_shard``-ed model, for the reshard.

    A shard that already has ``dtype`` and sits on ``device`` is returned as a view (no copy: the reshard
    reads the training weights in place); otherwise as a cast/moved copy (fp32 master weights with a
    bf16 rollout, CPU-offloaded shards with a GPU rollout) that the caller drops after the transition.
    Call it at every transition: optimizer steps update the shards in place, but FSDP owns the objects.
    """
    from torch.distributed.tensor import DTensor

    _reshard(module)
    out = {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param.detach()
            out[name] = local.to(device=device, dtype=dtype).contiguous().reshape(-1)
    return out


def megatron_reshard_sources(module: torch.nn.Module, dtype: torch.dtype, device: torch.device | str
                             ) -> dict[str, torch.Tensor]:
    """``{parameter name: this rank's Megatron shard, 1-D}``: views where dtype and device already match (the
    usual case: the reshard reads the training weights in place), cast/moved copies otherwise."""
    with torch.no_grad():
        return {name: p.detach().to(device=device, dtype=dtype).contiguous().reshape(-1)
                for name, p in module.named_parameters()}


def _reshard(module: torch.nn.Module) -> None:
    """Back to sharded parameters, whose local tensors are what the plan addresses: a forward outside
    backward leaves the root's parameters unsharded (FSDP2 does not reshard the root after forward)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def check_fsdp_module(module: torch.nn.Module, config: ModelConfig, training: FSDPLayout, rank: int) -> None:
    """Raise :class:`LayoutError` unless ``module``'s parameters are exactly the layout's, each sharded
    ``Shard(0)`` over a mesh of the layout's shape, with this rank's shard of the layout's size."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DTensorShard

    _reshard(module)
    params = dict(module.named_parameters())
    layouts = {p.name: p for p in training.params(config)}
    missing, unexpected = sorted(set(layouts) - set(params)), sorted(set(params) - set(layouts))
    if missing or unexpected:
        raise LayoutError(f"hybrid engine: expected the FSDP model's parameters to be {training}'s (the config's HF "
                          f"tensors), found missing {missing} and unexpected {unexpected}")
    _, replicate, shard = training.coords(rank)
    mesh_shape = (training.shard,) if training.replicate == 1 else (training.replicate, training.shard)
    coordinate = (shard,) if training.replicate == 1 else (replicate, shard)
    shapes = hf_tensor_shapes(config)
    for name, param in params.items():
        want = local_shape(layouts[name], shapes, training.shard, shard)
        if isinstance(param, DTensor):
            shape, at = tuple(param.device_mesh.shape), tuple(param.device_mesh.get_coordinate() or ())
            if len(shape) == 2 and shape[0] == 1:  # an HSDP mesh of one replicate is plain FSDP
                shape, at = shape[1:], at[1:]
            found = (f"placements {param.placements} on mesh {shape} at {at}, "
                     f"local shape {tuple(param.to_local().shape)}")
            ok = (param.placements[-1] == DTensorShard(0) and shape == mesh_shape and at == coordinate
                  and tuple(param.to_local().shape) == want)
        else:
            found = f"a plain tensor of shape {tuple(param.shape)}"
            ok = training.world_size == 1 and tuple(param.shape) == want
        if not ok:
            raise LayoutError(f"hybrid engine: {name}: expected Shard(0) on a {mesh_shape} mesh at {coordinate} "
                              f"with local shape {want} ({training}, rank {rank}), found {found}")


class HybridEngine:
    """Reshards the actor's weights into the rollout engine's flat buffer and back out of it.

    Megatron (:class:`TrainingLayout`): the actor's parameters are rebound (once) to views of one flat
    training buffer in ``training_param_specs`` order unless Megatron's distributed optimizer already
    keeps them in one buffer; the executor's copy programs address both buffers by offset.

    FSDP2 (:class:`FSDPLayout`): nothing is rebound; every transition reads the local shards anew
    (:func:`fsdp_reshard_sources`), cast and moved to the rollout buffer's dtype and device only when
    they differ. The executor is bound at the first transition, when that buffer is known.
    """

    def __init__(self, actor_engine: Any, rollout: Any, model_config: ModelConfig, training: AnyTrainingLayout,
                 rollout_tp: int, bucket_bytes: int, dtype: str):
        rank = dist.get_rank()
        self.rollout = rollout
        self.groups = derive_groups(training, rollout_tp)
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
        if isinstance(training, FSDPLayout):
            check_fsdp_module(actor_engine.module, model_config, training, rank)
            module = actor_engine.module
            self._sources_of = lambda into: fsdp_reshard_sources(module, into.dtype, into.device)
        else:
            from megatron.core import parallel_state as mpu

            bound = self._bind_training_buffer(actor_engine, model_config, training, mpu)
            if bound is None:
                module = actor_engine.module
                self._sources_of = lambda into: megatron_reshard_sources(module, into.dtype, into.device)
            else:
                self.executor = ReshardExecutor(plan, bound[0], bound[1], specs, process_groups)

    @staticmethod
    def _bind_training_buffer(engine: Any, model_config: ModelConfig, training: TrainingLayout, mpu):
        """(flat buffer, offsets) the parameters are views of: Megatron's one param buffer (distributed
        optimizer), else one this rebinds them into. None when the distributed optimizer keeps them in several
        buffers (an MoE model's dense and expert parameters): the transitions then read them by name."""
        params = dict(engine.module.named_parameters())
        buffers = [*(getattr(engine.model, "buffers", None) or []),
                   *(getattr(engine.model, "expert_parallel_buffers", None) or [])]
        param_data = [b.param_data for b in buffers if getattr(b, "param_data", None) is not None]
        if len(param_data) == 1:  # distributed optimizer: parameters already live in one buffer
            return param_data[0], offsets_from_views(param_data[0], params)
        if len(param_data) > 1:  # rebinding would detach them from the optimizer's buffers
            return None
        _, ep_rank, etp_rank = training.expert_coords(dist.get_rank())
        specs = training_param_specs(model_config, training.tp, training.pp, mpu.get_tensor_model_parallel_rank(),
                                     mpu.get_pipeline_model_parallel_rank(), training.ep, ep_rank, training.etp,
                                     etp_rank)
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
        into = self.rollout.weight_buffer()
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
        self.rollout.release()


