"""PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``): read one for
``lora_adapter_path`` / ``lora.adapter_path`` (checked against the model: rank, alpha, base and every shape) and
write one from full HF-named adapters (what ``peft.PeftModel.from_pretrained(base, dir)`` loads).

Tensor names inside verl-hpc are the HF module's: ``model.layers.0.self_attn.q_proj.lora_A.weight``; on disk PEFT
prefixes them with ``base_model.model.``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from verl.engine.lora import LoRAError, LoRASettings

PREFIX = "base_model.model."
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT adapter options verl-hpc does not apply, with the value that means "off" (an empty pattern is off too).
UNSUPPORTED_ADAPTER_KEYS = {"use_rslora": False, "use_dora": False, "alpha_pattern": {}, "rank_pattern": {},
                            "modules_to_save": None, "bias": "none"}


def _hf_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    from verl.models.config import ModelConfig
    from verl.models.spec.registry import model_spec

    config = ModelConfig.from_pretrained(model_path)
    return {k: tuple(v) for k, v in model_spec(config.model_type).hf_shapes(config).items()}


def read_adapter(adapter_dir: str, settings: LoRASettings, model_path: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors by HF name, after checking it fits ``settings`` and the model at ``model_path``."""
    from safetensors.torch import load_file

    where = f"{settings.where}.{'adapter_path' if settings.where.endswith('.lora') else 'lora_adapter_path'}"
    config_file, weights_file = os.path.join(adapter_dir, CONFIG), os.path.join(adapter_dir, WEIGHTS)
    for path in (config_file, weights_file):
        if not os.path.isfile(path):
            raise LoRAError(f"{where}: expected a PEFT adapter directory with {CONFIG} and {WEIGHTS}, found no "
                            f"{path}")
    with open(config_file) as f:
        adapter_config = json.load(f)
    if adapter_config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: expected a LoRA adapter, found peft_type {adapter_config.get('peft_type')!r}")
    if int(adapter_config.get("r", -1)) != settings.rank:
        raise LoRAError(f"{where}: expected an adapter of rank {settings.rank} (the configured rank), found r="
                        f"{adapter_config.get('r')}")
    if float(adapter_config.get("lora_alpha", -1)) != settings.alpha:
        raise LoRAError(f"{where}: expected lora_alpha {settings.alpha} (the configured alpha), found "
                        f"{adapter_config.get('lora_alpha')}")
    # What would change the adapter's effect beyond (alpha / r) B A, which is all verl-hpc applies: refused rather
    # than loaded with the wrong scaling (rsLoRA scales by alpha / sqrt(r)) or the wrong per-module rank or alpha.
    for key, plain in UNSUPPORTED_ADAPTER_KEYS.items():
        value = adapter_config.get(key)
        if value not in (None, plain):
            raise LoRAError(f"{where}: expected {CONFIG} with {key}={plain!r} (verl-hpc applies alpha/r to every "
                            f"module), found {key}={value!r}")
    shapes = _hf_shapes(model_path)
    tensors = {}
    for name, tensor in load_file(weights_file).items():
        hf = name.removeprefix(PREFIX).replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        base = hf.replace(".lora_A.weight", ".weight").replace(".lora_B.weight", ".weight")
        if base not in shapes:
            raise LoRAError(f"{where}: {name} adapts {base}, which the model at {model_path} does not have (an "
                            "adapter for another base model?)")
        out_dim, in_dim = shapes[base]
        want = (settings.rank, in_dim) if ".lora_A." in hf else (out_dim, settings.rank)
        if tuple(tensor.shape) != want:
            raise LoRAError(f"{where}: {name}: expected shape {want} for {base} {shapes[base]} at rank "
                            f"{settings.rank}, found {tuple(tensor.shape)} (an adapter for another base model?)")
        tensors[hf] = tensor
    return _Tensors(tensors, where)


class _Tensors(dict):
    """The adapter's tensors; a lookup of one it lacks names the directory and the tensor."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str):
        super().__init__(tensors)
        self.where = where

    def __missing__(self, name: str) -> torch.Tensor:
        raise LoRAError(f"{self.where}: expected {PREFIX}{name} (the model's LoRA targets), found it missing")


def adapter_config(settings: LoRASettings, base_path: str, target_modules: list[str]) -> dict[str, Any]:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
            "lora_dropout": settings.dropout, "target_modules": sorted(target_modules), "bias": "none",
            "base_model_name_or_path": os.path.abspath(base_path) if os.path.exists(base_path) else base_path,
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True, "inference_mode": True}


def write_adapter(out_dir: str, tensors: dict[str, torch.Tensor], settings: LoRASettings, base_path: str,
                  tokenizer: Any | None = None) -> None:
    """``tensors`` (HF names) as a PEFT adapter directory at ``out_dir``, replaced atomically; its
    ``adapter_config.json`` names the base (``base_model_name_or_path``), and the tokenizer's files go beside it
    when given."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from verl.utils.checkpoint import fsync_path, fsync_tree

    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".adapter_", dir=parent)
    try:
        save_file({PREFIX + k: v.detach().cpu().clone().contiguous() for k, v in sorted(tensors.items())},
                  os.path.join(staging, WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(staging, CONFIG), "w") as f:
            json.dump(adapter_config(settings, base_path, targets), f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        fsync_tree(staging)  # on disk before the rename publishes it (as the HF export): no zero-filled files
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a full disk or a crash of the writer leaves no staging dir
        raise
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    fsync_path(parent)
