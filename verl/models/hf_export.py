"""HF export of the Megatron actor: a directory transformers loads with ``from_pretrained``.

``<out_dir>/`` holds config.json (the actor's HF config, ``torch_dtype`` set to the exported dtype),
model.safetensors, the tokenizer files and generation_config.json (the model's own when its
directory has one, else built from the tokenizer's special tokens). It is written to
``<out_dir>.tmp`` and renamed into place: readers see the previous export or the new one, never a
half-written directory (during the swap ``<out_dir>`` is briefly absent).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from verl.models.config import ModelConfig

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def hf_config_dict(model_path: str, config: ModelConfig, dtype: torch.dtype) -> dict:
    """The actor's HF config.json contents for an export in ``dtype``."""
    file = os.path.join(model_path, "config.json") if os.path.isdir(model_path) else model_path
    with open(file, encoding="utf-8") as fh:
        hf_config = json.load(fh)
    hf_config.setdefault("architectures", [ARCHITECTURES[config.model_type]])
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return hf_config


def _write_generation_config(model_path: str, out_dir: str, hf_config: dict, tokenizer: Any | None) -> None:
    source = os.path.join(model_path, "generation_config.json") if os.path.isdir(model_path) else None
    if source and os.path.isfile(source):
        shutil.copyfile(source, os.path.join(out_dir, "generation_config.json"))
        return
    from transformers import GenerationConfig

    def token(name: str):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        return hf_config.get(name) if value is None else value

    GenerationConfig(bos_token_id=token("bos_token_id"), eos_token_id=token("eos_token_id"),
                     pad_token_id=token("pad_token_id")).save_pretrained(out_dir)


def replace_dir(staging: str, out_dir: str) -> None:
    """Move the finished ``staging`` directory to ``out_dir``, replacing a previous one."""
    old = out_dir + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out_dir):
        os.rename(out_dir, old)
    os.rename(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def export_actor_hf(engine: Any, config: ModelConfig, model_path: str, out_dir: str, tokenizer: Any | None) -> None:
    """Collective over every rank: the first DP replica gathers the full weights (over its TP/PP
    group) and global rank 0 writes them; every rank returns once the directory is in place."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore.weights import gather_hf_from_model, save_hf_checkpoint

    tensors = gather_hf_from_model(engine.module, config, "lm") if mpu.get_data_parallel_rank() == 0 else None
    if dist.get_rank() == 0:
        staging = os.path.abspath(out_dir) + ".tmp"
        shutil.rmtree(staging, ignore_errors=True)
        save_hf_checkpoint(tensors, staging)
        hf_config = hf_config_dict(model_path, config, next(iter(tensors.values())).dtype)
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(hf_config, fh, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        _write_generation_config(model_path, staging, hf_config, tokenizer)
        replace_dir(staging, os.path.abspath(out_dir))
    dist.barrier()
