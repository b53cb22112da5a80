"""HF export: a directory transformers loads with ``from_pretrained``, written as a stream.

The one HF directory writer of verl-hpc (the actor export at the end of ``verl train``, ``verl sft``'s
``<output_dir>/hf`` and ``verl convert mcore-to-hf``). ``<out_dir>/`` holds config.json
(``torch_dtype`` set to the exported dtype), ``model.safetensors`` or, past one shard,
``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json`` (transformers' names),
the tokenizer files and generation_config.json when given.

Memory: tensors arrive one at a time (gathered over the TP/PP group by
``verl.models.mcore.weights.iter_hf_from_model``) and are held only until their shard is written,
so the writer's peak extra memory is one shard (``max_shard_bytes``) plus the largest tensor, not a
multiple of the model. Atomicity: everything is written to ``<out_dir>.tmp-<pid>`` and renamed into
place; readers see the previous export or the new one, never a half-written directory (during the
swap ``<out_dir>`` is briefly absent).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from verl.models.config import ModelConfig

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Bounds the writer's memory (one shard is held before it is written); transformers' default is 5 GB.
DEFAULT_MAX_SHARD_BYTES = 2 * 1024 ** 3
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class HFExportError(ValueError):
    """Tensors that cannot make an HF checkpoint (a name twice, an unsupported dtype)."""


def write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """One safetensors file (8-byte header length, JSON header, raw little-endian data), written from
    the tensors' own memory: no serialised copy of the file is built first."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise HFExportError(f"{name}: expected one of the safetensors dtypes, found {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for _, tensor in tensors:
            if tensor.numel():
                fh.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


class ShardedSafetensorsWriter:
    """Takes (name, tensor) one at a time; writes a shard each time ``max_shard_bytes`` would be passed
    (a tensor larger than that gets a shard of its own). ``close()`` names the shards as transformers
    does and writes the index when there is more than one."""

    def __init__(self, out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise HFExportError(f"max_shard_bytes: expected a positive size, found {max_shard_bytes}")
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []  # (temporary file, names)
        self.total_bytes = 0
        self.names: set[str] = set()
        self.dtype: torch.dtype | None = None  # of the first floating-point tensor
        os.makedirs(out_dir, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise HFExportError(f"HF export: expected each tensor name once, found {name} twice")
        self.names.add(name)
        tensor = tensor.detach().to("cpu").contiguous()
        if self.dtype is None and tensor.is_floating_point():
            self.dtype = tensor.dtype
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.pending.append((name, tensor))
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        file = os.path.join(self.out_dir, f".shard-{len(self.shards) + 1:05d}.partial")
        write_safetensors(file, self.pending)
        self.shards.append((file, [name for name, _ in self.pending]))
        self.pending, self.pending_bytes = [], 0

    def close(self) -> list[str]:
        """Write the last shard and the index; returns the file names written."""
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            os.replace(self.shards[0][0], os.path.join(self.out_dir, SAFETENSORS_SINGLE))
            return [SAFETENSORS_SINGLE]
        files, weight_map = [], {}
        for i, (tmp, names) in enumerate(self.shards, start=1):
            file = f"model-{i:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(tmp, os.path.join(self.out_dir, file))
            files.append(file)
            weight_map.update({name: file for name in names})
        with open(os.path.join(self.out_dir, SAFETENSORS_INDEX), "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, fh, indent=2)
        return files + [SAFETENSORS_INDEX]


def read_hf_config(model_path: str) -> dict:
    """config.json of ``model_path`` (an HF directory, or the config file itself)."""
    file = os.path.join(model_path, "config.json") if os.path.isdir(model_path) else model_path
    with open(file, encoding="utf-8") as fh:
        return json.load(fh)


def replace_dir(staging: str, out_dir: str) -> None:
    """Move the finished ``staging`` directory to ``out_dir``, replacing a previous one."""
    old = f"{out_dir}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out_dir):
        os.rename(out_dir, old)
    os.rename(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def write_hf_dir(out_dir: str, tensors: Iterable[tuple[str, torch.Tensor]], hf_config: dict,
                 tokenizer: Any | None = None, generation_config: dict | str | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, replace: bool = True) -> str:
    """Stream ``tensors`` into safetensors shards, then config.json (``torch_dtype`` = the tensors'
    floating dtype), the tokenizer's files and generation_config.json (a dict, or a file to copy), in
    a staging directory renamed to ``out_dir``; ``replace`` False refuses an existing ``out_dir``."""
    out_dir = os.path.abspath(out_dir)
    if not replace and os.path.exists(out_dir):
        raise FileExistsError(f"--out: expected a path that does not exist yet, found {out_dir}")
    staging = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        writer = ShardedSafetensorsWriter(staging, max_shard_bytes)
        for name, tensor in tensors:
            writer.add(name, tensor)
            del tensor  # the writer holds it only until its shard is written
        writer.close()
        config = dict(hf_config)
        if writer.dtype is not None:
            config["torch_dtype"] = str(writer.dtype).removeprefix("torch.")
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(config, fh, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if isinstance(generation_config, str):
            shutil.copyfile(generation_config, os.path.join(staging, "generation_config.json"))
        elif generation_config is not None:
            with open(os.path.join(staging, "generation_config.json"), "w", encoding="utf-8") as fh:
                json.dump(generation_config, fh, indent=2)
        if replace:
            replace_dir(staging, out_dir)
        else:
            os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written is left behind
        raise
    return out_dir


def special_token_ids(tokenizer: Any | None, hf_config: dict) -> dict:
    """bos/eos/pad ids: the tokenizer's, else the model config's; absent ones left out."""
    ids = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        value = hf_config.get(name) if value is None else value
        if value is not None:
            ids[name] = value
    return ids


def export_model_hf(module: torch.nn.Module, config: ModelConfig, out_dir: str, hf_config: dict,
                    tokenizer: Any | None = None, generation_config: dict | str | None = None, head: str = "lm",
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, replace: bool = True,
                    gather: bool = True) -> str | None:
    """Collective over the model-parallel group of ``module`` (ranks with ``gather`` False skip it):
    its (tp 0, pp 0) rank writes ``out_dir`` from the tensors streamed to it; returns the path there,
    None elsewhere."""
    from verl.models.mcore.weights import iter_hf_from_model

    if not gather:
        return None
    stream = iter_hf_from_model(module, config, head)
    from megatron.core import parallel_state as mpu

    if mpu.get_tensor_model_parallel_rank() != 0 or mpu.get_pipeline_model_parallel_rank() != 0:
        for _ in stream:  # sends this rank's shards; yields nothing here
            pass
        return None
    hf_config = dict(hf_config)
    hf_config.setdefault("architectures", [ARCHITECTURES[config.model_type]])
    return write_hf_dir(out_dir, stream, hf_config, tokenizer, generation_config, max_shard_bytes, replace)


def export_actor_hf(engine: Any, config: ModelConfig, model_path: str, out_dir: str, tokenizer: Any | None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Collective over every rank: the first DP replica streams the weights (over its TP/PP group) to
    global rank 0, which writes them; every rank returns once the directory is in place. The model's
    own generation_config.json is kept when its directory has one, else built from the tokenizer's
    special tokens."""
    from megatron.core import parallel_state as mpu

    hf_config = read_hf_config(model_path)
    source = os.path.join(model_path, "generation_config.json") if os.path.isdir(model_path) else None
    generation = source if source and os.path.isfile(source) else special_token_ids(tokenizer, hf_config)
    export_model_hf(engine.module, config, out_dir, hf_config, tokenizer, generation, "lm", max_shard_bytes,
                    gather=mpu.get_data_parallel_rank() == 0)
    dist.barrier()
