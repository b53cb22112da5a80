"""The FSDP2 side of the 3D-HybridEngine: a ``fully_shard``-ed transformers model's local shards, checked
against its :class:`~verl.hybrid_engine.layouts.FSDPLayout` and handed to the reshard by name at every
transition (nothing is rebound: FSDP owns the parameter objects).
"""

from __future__ import annotations

import torch

from verl.engine.base import BoundBuffer
from verl.engine.lora import hf_base_name, is_adapter_name
from verl.hybrid_engine.layouts import FSDPLayout, LayoutError, hf_tensor_shapes, local_shape
from verl.hybrid_engine.lora_sync import LoRASyncSource
from verl.models.config import ModelConfig


def reshard_module(module: torch.nn.Module) -> None:
    """Back to sharded parameters, whose local tensors are what the plan addresses: a forward outside
    backward leaves the root's parameters unsharded (FSDP2 does not reshard the root after forward)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def fsdp_reshard_sources(module: torch.nn.Module, dtype: torch.dtype, device: torch.device | str
                         ) -> dict[str, torch.Tensor]:
    """``{parameter name: this rank's local shard, 1-D}`` of a ``fully_shard``-ed model, for the reshard.

    A shard that already has ``dtype`` and sits on ``device`` is returned as a view (no copy: the reshard
    reads the training weights in place); otherwise as a cast/moved copy (fp32 master weights with a
    bf16 rollout, CPU-offloaded shards with a GPU rollout) that the caller drops after the transition.
    Call it at every transition: optimizer steps update the shards in place, but FSDP owns the objects.
    """
    from torch.distributed.tensor import DTensor

    reshard_module(module)
    out = {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param.detach()
            out[name] = local.to(device=device, dtype=dtype).contiguous().reshape(-1)
    return out


def check_fsdp_module(module: torch.nn.Module, config: ModelConfig, training: FSDPLayout, rank: int) -> None:
    """Raise :class:`LayoutError` unless ``module``'s parameters are exactly the layout's, each sharded
    ``Shard(0)`` over a mesh of the layout's shape, with this rank's shard of the layout's size."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DTensorShard

    if not isinstance(training, FSDPLayout):
        raise LayoutError(f"hybrid engine: expected an FSDP layout for the FSDP model, found {training}")
    reshard_module(module)
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


class FSDPReshardSource:
    """The reshard's view of a ``fully_shard``-ed model (what :class:`~verl.engine.fsdp.engine.FSDPEngine` hands
    the hybrid engine and the rollout pool, and what a bench or test wraps a bare model in): checked once, read
    by name at every transition."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def bind_reshard(self, model_config: ModelConfig, training: FSDPLayout) -> BoundBuffer | None:
        import torch.distributed as dist

        check_fsdp_module(self.module, model_config, training, dist.get_rank())
        return None

    def reshard_sources(self, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        return fsdp_reshard_sources(self.module, dtype, device)

    def lora_sync_source(self, model_config: ModelConfig, training: FSDPLayout) -> None:
        """A bare model has no adapter-only sync (the engine contract's default: the dense weights every time)."""
        return None


class FSDPLoRASyncSource(LoRASyncSource):
    """A PEFT-under-FSDP2 actor's sources for the adapter-only sync (``lora.merge=false``;
    :mod:`verl.hybrid_engine.lora_sync`): the frozen base's local shards by HF name (the first sync), the adapters'
    by PEFT name (every sync; ``A`` is split over r like every FSDP parameter), and a fingerprint of the live
    adapters. Collective-free: every rank holds the same PEFT layers."""

    def __init__(self, module: torch.nn.Module, model_config: ModelConfig, settings, training: FSDPLayout):
        from verl.hybrid_engine.lora_sync import AdapterSpec, AdapterTrainingLayout

        layers = {hf_base_name(n) + ".weight" for n, m in module.named_modules()
                  if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
        modules = tuple(n for n in hf_tensor_shapes(model_config) if n in layers)
        self.spec = AdapterSpec(settings.rank, settings.scale, modules, shared_a=False)
        self.training = AdapterTrainingLayout(training, self.spec, flat_shards=True)
        self.module = module

    def base_sources(self, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        return fsdp_reshard_sources(BaseNamesView(self.module), dtype, device)

    def adapter_params(self) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        reshard_module(self.module)
        return {name: (p.to_local() if isinstance(p, DTensor) else p) for name, p in self.module.named_parameters()
                if is_adapter_name(name)}



class BaseNamesView:
    """A PEFT model as the reshard's layout check sees a dense one: base parameters under their HF names (the
    merged-weights reshard and the adapter-only sync's base both read it)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def modules(self):
        return self.model.modules()

    def named_parameters(self):
        return ((hf_base_name(n), p) for n, p in self.model.named_parameters() if not is_adapter_name(n))
