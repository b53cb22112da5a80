"""PEFT's LoRA layers on a transformers model under FSDP2 (names and shards: :mod:`verl.engine.lora`).

``inject`` runs before ``fully_shard`` (PEFT replaces each targeted ``nn.Linear`` by a LoRA layer holding it as
``base_layer``); FSDP then shards the adapters like every parameter (``Shard(0)``). The base parameters keep
their values under ``<module>.base_layer.weight``; :func:`hf_base_name` gives back the HF name, which the weight
loader (:func:`verl.engine.fsdp.model.load_sharded_weights`), the reshard check and the merged reshard sources use.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from verl.engine.lora import LoRAError, LoRASettings, hf_base_name, in_modules, is_adapter_name, matches


def _target_names(model: torch.nn.Module, settings: LoRASettings) -> list[str]:
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n
               and n.rsplit(".", 1)[-1] not in ("lm_head", "score")]
    if settings.target_modules == ("all-linear",):
        found = linears
    else:
        found = [n for n in linears if matches(n, settings.target_modules)]
    found = [n for n in found if not matches(n, settings.exclude_modules)]
    if not found:
        raise LoRAError(f"{settings.where}.target_modules: expected HF linear module names (all-linear, or e.g. "
                        f"q_proj, v_proj), found none matching {list(settings.target_modules)}"
                        + (f" minus exclude_modules {list(settings.exclude_modules)}" if settings.exclude_modules
                           else ""))
    return found


def inject(model: torch.nn.Module, settings: LoRASettings, keep: Sequence[str] = ()) -> list[str]:
    """PEFT LoRA layers on the targeted linears (in place, no PeftModel wrapper), everything else frozen but the
    modules ``keep`` names (a critic's value head: :func:`verl.engine.lora.value_head`)."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = _target_names(model, settings)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, bias="none")
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name) or in_modules(name, keep))
    return targets


def adapter_hf_name(name: str) -> str:
    """PEFT's in-model adapter name (``q_proj.lora_A.default.weight``) as its HF adapter name."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def init_adapters(model: torch.nn.Module, seed: int, full: dict[str, torch.Tensor] | None = None) -> None:
    """Every adapter's local shard from its full value: ``full`` (HF names) when given, else A = PEFT's
    kaiming-uniform draw seeded by ``seed`` and the name (the same on every rank), B = 0."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter_name(name):
                continue
            hf = adapter_hf_name(name)
            if full is not None:
                value = full[hf]
                if tuple(value.shape) != tuple(param.shape):
                    raise LoRAError(f"LoRA adapter: {hf}: expected shape {tuple(param.shape)}, found "
                                    f"{tuple(value.shape)}")
            elif ".lora_A." in name:
                value = torch.empty(tuple(param.shape))
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(hf.encode()))
                torch.nn.init.kaiming_uniform_(value, a=5 ** 0.5, generator=generator)
            else:
                value = torch.zeros(tuple(param.shape))
            if isinstance(param, DTensor):
                value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements,
                                          src_data_rank=None).to_local()
                param.to_local().copy_(value)
            else:
                param.copy_(value)


def _layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}


def merged_reshard_sources(model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str
                           ) -> dict[str, torch.Tensor]:
    """``{HF name: this rank's Shard(0) rows of W + (alpha/r) B A, 1-D}``: ``B``'s local rows are ``W``'s local
    rows, ``A`` (split over r) is gathered whole (r x in, small). Collective: every rank, same order."""
    from torch.distributed.tensor import DTensor

    from verl.engine.fsdp.reshard import reshard_module

    reshard_module(model)
    layers = {f"{n}.base_layer.weight": m for n, m in _layers(model).items()}
    out = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_name(name):
                continue
            local = (param.to_local() if isinstance(param, DTensor) else param.detach()).float()
            layer = layers.get(name)
            if layer is not None and not layer.disable_adapters:
                a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                a_full = a.full_tensor() if isinstance(a, DTensor) else a.detach()
                b_local = b.to_local() if isinstance(b, DTensor) else b.detach()
                local = local + layer.scaling["default"] * (b_local.float() @ a_full.float())
            out[hf_base_name(name)] = local.to(device=device, dtype=dtype).contiguous().reshape(-1)
    return out


def iter_merged_tensors(model: torch.nn.Module):
    """(HF name, full CPU tensor) of the merged model, one parameter at a time: each base parameter gathered
    (``full_tensor``), an adapted linear's as ``W + (alpha/r) B A`` in fp32, cast back. Collective."""
    from torch.distributed.tensor import DTensor

    def full(p):
        return (p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu()

    layers = {f"{n}.base_layer.weight": m for n, m in _layers(model).items()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_name(name):
                continue
            value = full(param)
            layer = layers.get(name)
            if layer is not None:
                delta = full(layer.lora_B["default"].weight).float() @ full(layer.lora_A["default"].weight).float()
                value = (value.float() + layer.scaling["default"] * delta).to(value.dtype)
            yield hf_base_name(name), value.clone()


def full_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter as a full HF-named tensor on every rank. Collective."""
    from torch.distributed.tensor import DTensor

    return {adapter_hf_name(n): (p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu().clone()
            for n, p in model.named_parameters() if is_adapter_name(n)}
