"""The Megatron side of the 3D-HybridEngine: the actor's parameters as views of one flat training buffer (the
distributed optimizer's, or one they are rebound into once) that the reshard's copy programs address by
offset, or, when the distributed optimizer keeps them in several buffers (an MoE model's dense and expert
parameters), read by name at every transition.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.engine.base import BoundBuffer
from verl.hybrid_engine.executor import offsets_from_views
from verl.hybrid_engine.layouts import LayoutError, TrainingLayout, training_param_specs
from verl.hybrid_engine.lora_sync import LoRASyncSource
from verl.models.config import ModelConfig


def megatron_reshard_sources(module: torch.nn.Module, dtype: torch.dtype, device: torch.device | str
                             ) -> dict[str, torch.Tensor]:
    """``{parameter name: this rank's Megatron shard, 1-D}``: views where dtype and device already match (the
    usual case: the reshard reads the training weights in place), cast/moved copies otherwise."""
    with torch.no_grad():
        return {name: p.detach().to(device=device, dtype=dtype).contiguous().reshape(-1)
                for name, p in module.named_parameters()}


def bind_training_buffer(module: torch.nn.Module, model: Any, model_config: ModelConfig,
                         training: TrainingLayout) -> BoundBuffer | None:
    """(flat buffer, offsets) ``module``'s parameters are views of: Megatron's one param buffer (distributed
    optimizer; ``model`` is the DDP wrapper holding it), else one this rebinds them into. None when the
    distributed optimizer keeps them in several buffers (an MoE model's dense and expert parameters): the
    transitions then read them by name."""
    from megatron.core import parallel_state as mpu

    if not isinstance(training, TrainingLayout):
        raise LayoutError(f"hybrid engine: expected a Megatron layout for the Megatron model, found {training}")
    params = dict(module.named_parameters())
    buffers = [*(getattr(model, "buffers", None) or []), *(getattr(model, "expert_parallel_buffers", None) or [])]
    param_data = [b.param_data for b in buffers if getattr(b, "param_data", None) is not None]
    if len(param_data) == 1:  # distributed optimizer: parameters already live in one buffer
        return BoundBuffer(param_data[0], offsets_from_views(param_data[0], params))
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
    return BoundBuffer(flat, offsets)


class MegatronLoRASyncSource(LoRASyncSource):
    """A LoRA actor's sources for the adapter-only sync (``lora.merge=false``; :mod:`verl.hybrid_engine.lora_sync`):
    the frozen base by its Megatron names (the first sync), the adapters by theirs (every sync), and a fingerprint of
    the live adapters. The adapted HF weights come from the config and the settings (every stage's, so every rank
    plans the same sync)."""

    def __init__(self, module: torch.nn.Module, model_config: ModelConfig, settings: Any, training: Any):
        from verl.engine.lora import is_adapter_name, matches
        from verl.engine.megatron.config_rules import RULES
        from verl.hybrid_engine.layouts import hf_tensor_shapes
        from verl.hybrid_engine.lora_sync import AdapterSpec, AdapterTrainingLayout
        from verl.models.mcore.weights import weight_rules

        rules = {r.mcore: r.hf for r in weight_rules(model_config, 1, 0)}
        adapted = set()
        for name in RULES.lora_candidate_modules(model_config):
            if matches(name, settings.target_modules) and not matches(name, settings.exclude_modules):
                adapted.update(rules[f"{name}.weight"])
        modules = tuple(n for n in hf_tensor_shapes(model_config) if n in adapted)
        self.spec = AdapterSpec(settings.rank, settings.scale, modules, shared_a=True)
        self.training = AdapterTrainingLayout(training, self.spec)
        self.module = module
        self._is_adapter = is_adapter_name

    def base_sources(self, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {name: p.detach().to(device=device, dtype=dtype).contiguous().reshape(-1)
                    for name, p in self.module.named_parameters() if not self._is_adapter(name)}

    def adapter_params(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.module.named_parameters() if self._is_adapter(name)}

