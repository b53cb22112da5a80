"""HF transformers models for the FSDP engine, built from a config.json or loaded from an HF directory.

Heads, as verl's FSDP workers: ``lm`` is ``AutoModelForCausalLM``; ``value`` (critic) and ``score`` (reward
model) are ``AutoModelForTokenClassification`` with one label, no dropout and no bias (the layout of an HF
``*ForSequenceClassification`` score head and of the Megatron engine's value head). A value head that the
checkpoint does not have (an LM checkpoint) starts at zero, as the Megatron critic's does.
"""

from __future__ import annotations

import torch

from verl.models.hf_io import HFCheckpoint, has_hf_weights, read_config

HEADS = ("lm", "value", "score")


def hf_model_config(model_path: str, head: str = "lm"):
    """The transformers config of an HF directory or a bare config.json."""
    from transformers import AutoConfig

    if head not in HEADS:
        raise ValueError(f"head: expected one of {HEADS}, found {head!r}")
    raw = read_config(model_path)
    model_type = raw.pop("model_type")
    raw.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **raw)
    if head != "lm":
        config.num_labels = 1
        config.classifier_dropout = 0.0
        config.token_classification_bias = False
    return config


def build_empty_hf_model(model_path: str, head: str = "lm", dtype: torch.dtype = torch.float32):
    """The model's structure on the meta device (no memory): FSDP shards it, then each rank allocates and
    loads only its shards (:func:`load_sharded_weights`)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    config = hf_model_config(model_path, head)
    cls = AutoModelForCausalLM if head == "lm" else AutoModelForTokenClassification
    with torch.device("meta"):
        model = cls.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


def reset_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Recompute the non-persistent buffers (neither a checkpoint nor the meta-device build holds them), on
    ``device``: the RoPE tables of every rotary-embedding module, rebuilt from the config; any other (an embedding's
    scale) by the model's own initializer (transformers' ``_init_weights``, as its own meta-device loading does),
    with the module's parameters marked initialised so that only the buffers are written."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(config=model.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
        elif getattr(module, "_non_persistent_buffers_set", None) and hasattr(model, "_init_weights"):
            for name in module._non_persistent_buffers_set:
                buffer = getattr(module, name)
                if buffer is not None and buffer.device != device:
                    setattr(module, name, torch.empty_like(buffer, device=device))
            params = list(module.parameters(recurse=False))
            marks = [getattr(p, "_is_hf_initialized", None) for p in params]
            for p in params:
                p._is_hf_initialized = True
            try:
                with torch.no_grad():
                    model._init_weights(module)
            finally:
                for p, mark in zip(params, marks, strict=True):
                    if mark is None:
                        del p._is_hf_initialized
                    else:
                        p._is_hf_initialized = mark


def load_sharded_weights(model: torch.nn.Module, model_path: str, head: str) -> None:
    """Each parameter's local shard from the HF checkpoint, one full tensor in memory at a time (read, cut to
    this rank's rows, copied, dropped). A score head the checkpoint lacks starts at zero. With PEFT's LoRA
    layers in the model: the base by its HF name, the adapters untouched (``lora.init_adapters`` of this folder
    sets them)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from verl.engine.lora import hf_base_name, is_adapter_name

    checkpoint = HFCheckpoint(model_path)
    with torch.no_grad():
        for peft_name, param in model.named_parameters():
            if is_adapter_name(peft_name):
                continue
            name = hf_base_name(peft_name)
            local = param.to_local() if isinstance(param, DTensor) else param
            if name not in checkpoint and head != "lm" and name.startswith("score."):
                local.zero_()
                continue
            full = checkpoint.get(name, tuple(param.shape))  # one clear error when it lacks it or differs
            if isinstance(param, DTensor):  # this rank's rows, cut locally (no communication)
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            local.copy_(full)


def build_hf_model(model_path: str, head: str = "lm", dtype: torch.dtype = torch.float32, seed: int = 0):
    """The full model on the CPU (FSDP shards it next). Without weights the init is seeded, so every rank
    builds the same model."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank and role is noise in a job log
    config = hf_model_config(model_path, head)
    cls = AutoModelForCausalLM if head == "lm" else AutoModelForTokenClassification
    torch.manual_seed(seed)
    if has_hf_weights(model_path):
        model, info = cls.from_pretrained(model_path, config=config, dtype=dtype, output_loading_info=True)
        if head != "lm" and "score.weight" in info.get("missing_keys", ()):
            with torch.no_grad():
                model.score.weight.zero_()
    else:
        model = cls.from_config(config, dtype=dtype)
        if head != "lm":
            with torch.no_grad():
                model.score.weight.zero_()
    model.config.use_cache = False  # training and scoring never reuse a KV cache
    return model
