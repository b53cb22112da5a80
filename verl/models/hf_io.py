"""HF model directories, read and written: the one place that knows their files (not their tensor names).

    <dir>/config.json                       the model config (a bare config.json path stands for it too)
    <dir>/generation_config.json            optional: bos/eos/pad ids, sampling defaults
    <dir>/model.safetensors                 the weights in one file, or
    <dir>/model-0000i-of-0000N.safetensors  shards, with
    <dir>/model.safetensors.index.json      {"metadata": {"total_size": bytes}, "weight_map": {tensor: shard}}

Reading is lazy: opening a checkpoint reads only the index and each file's JSON header (a multi-GB
checkpoint costs nothing), which is also where a cut or garbled file is caught, so names and shapes are
known before any tensor is read; tensors are then read one at a time (``safe_open``), whole or sliced.
Every problem is one ``CheckpointError`` line naming the file and what was expected.

Writing is a stream: tensors arrive one at a time and are held only until their shard (at most
``max_shard_bytes``; a larger tensor gets a shard of its own) is written, so the writer's peak extra
memory is one shard plus the largest tensor. Everything goes to ``<out_dir>.tmp-<host>-<pid>``, is fsynced and
renamed into place; readers see the previous directory or the new one, never a half-written one (during the swap
``<out_dir>`` is briefly absent). A staging directory a killed writer left is removed by the next write to the same
``<out_dir>`` (one of this host whose pid no longer runs). A full disk ends in :class:`DiskFullError`, one line,
with the staging directory removed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
from collections.abc import Iterable
from typing import Any

import torch

from verl.errors import OutputExistsError
from verl.utils.checkpoint import (
    DISK_FULL_ERRNOS,
    CheckpointError,
    DiskFullError,
    fsync_path,
    fsync_tree,
    pid_running,
)
from verl.utils.logging_utils import get_logger

logger = get_logger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Bounds the writer's memory (one shard is held before it is written); transformers' default is 5 GB.
DEFAULT_MAX_SHARD_BYTES = 2 * 1024 ** 3
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the header
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class HFWriteError(ValueError):
    """Tensors that cannot make an HF checkpoint (a name twice, an unsupported dtype, a bad shard size)."""


# ----------------------------------------------------------------------------- configs
def config_file(model_path: str) -> str:
    """The config.json of ``model_path``: an HF directory, or the config file itself."""
    return os.path.join(model_path, CONFIG_FILE) if os.path.isdir(model_path) else model_path


def read_config(model_path: str) -> dict:
    """config.json of an HF directory or a bare config.json, as a dict."""
    file = config_file(model_path)
    if not os.path.isfile(file):
        raise CheckpointError(f"expected {file} to exist, found nothing")
    try:
        with open(file, encoding="utf-8") as fh:
            config = json.load(fh)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: expected JSON, found invalid JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{file}: expected JSON, found bytes that are not UTF-8") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: expected a JSON object, found {type(config).__name__}")
    return config


def special_token_ids(tokenizer: Any | None, hf_config: dict) -> dict:
    """bos/eos/pad ids: the tokenizer's, else the model config's; absent ones left out."""
    ids = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = getattr(tokenizer, key, None) if tokenizer is not None else None
        value = hf_config.get(key) if value is None else value
        if value is not None:
            ids[key] = value
    return ids


def generation_config(model_path: str, tokenizer: Any | None = None) -> dict:
    """The model's generation settings: its directory's generation_config.json, with any bos/eos/pad id it
    does not set taken from the tokenizer, else from config.json (as transformers fills a missing one)."""
    file = os.path.join(model_path, GENERATION_CONFIG_FILE) if os.path.isdir(model_path) else None
    settings = read_config(file) if file is not None and os.path.isfile(file) else {}
    for key, value in special_token_ids(tokenizer, read_config(model_path)).items():
        if settings.get(key) is None:
            settings[key] = value
    return settings


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [v for v in value if isinstance(v, int)]


def _tokenizer_file_eos_id(model_dir: str) -> int | None:
    """The eos id tokenizer_config.json names (its ``eos_token`` string looked up in the added tokens or the
    vocabulary of tokenizer.json), without loading a tokenizer; None when the files do not say."""
    tok_config_file = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(tok_config_file):
        return None
    eos = read_config(tok_config_file).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    for token_id, entry in (read_config(tok_config_file).get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and entry.get("content") == eos:
            return int(token_id)
    tok_file = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(tok_file):
        tok = read_config(tok_file)
        for entry in tok.get("added_tokens") or []:
            if entry.get("content") == eos:
                return int(entry["id"])
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and isinstance(vocab.get(eos), int):
            return vocab[eos]
    return None


def eos_token_ids(model_path: str, tokenizer: Any | None = None) -> tuple[int, ...]:
    """Every id that ends a response: the union of generation_config.json's, config.json's and the tokenizer's
    eos (real checkpoints disagree among the three: Llama 3 Instruct's config says <|end_of_text|>, its
    tokenizer <|eot_id|>, its generation config both and <|eom_id|>). ``tokenizer`` None reads the tokenizer's
    eos from its files in ``model_path``. Ordered as listed, without repeats."""
    ids: list[int] = []
    model_dir = model_path if os.path.isdir(model_path) else None
    if model_dir is not None and os.path.isfile(os.path.join(model_dir, GENERATION_CONFIG_FILE)):
        ids += _id_list(read_config(os.path.join(model_dir, GENERATION_CONFIG_FILE)).get("eos_token_id"))
    ids += _id_list(read_config(model_path).get("eos_token_id"))
    if tokenizer is not None:
        ids += _id_list(getattr(tokenizer, "eos_token_id", None))
    elif model_dir is not None:
        ids += _id_list(_tokenizer_file_eos_id(model_dir))
    return tuple(dict.fromkeys(ids))


# ----------------------------------------------------------------------------- reading
def has_hf_weights(model_path: str) -> bool:
    """``model_path`` is a directory holding safetensors weights (a bare config.json, or a directory with
    only a config, means a seeded init)."""
    return os.path.isdir(model_path) and any(
        name.endswith(".safetensors") or name == SAFETENSORS_INDEX for name in os.listdir(model_path))


def read_safetensors_header(path: str) -> dict[str, dict]:
    """The tensors a safetensors file's JSON header lists (name -> dtype, shape, data_offsets), checked
    against the file's size: a cut file is shorter than its header says."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: expected a safetensors file, found {size} bytes")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{path}: expected a safetensors header of {header_len} bytes, "
                                      f"found a {size}-byte file")
            header = json.loads(fh.read(header_len))
    except CheckpointError:
        raise
    except OSError as err:
        raise CheckpointError(f"{path}: expected a readable safetensors file, found {err.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: expected a safetensors JSON header, found unreadable bytes") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: expected a safetensors JSON header, found {type(header).__name__}")
    try:
        tensors = {name: {"dtype": entry["dtype"], "shape": tuple(int(d) for d in entry["shape"]),
                          "data_offsets": (int(entry["data_offsets"][0]), int(entry["data_offsets"][1]))}
                   for name, entry in header.items() if name != "__metadata__"}
    except (KeyError, IndexError, TypeError, ValueError):
        raise CheckpointError(f"{path}: expected a dtype, shape and data_offsets for every tensor in its "
                              "header, found malformed entries") from None
    end = max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(f"{path}: expected {8 + header_len + end} bytes (its header's tensors), "
                              f"found {size} (cut file)")
    return tensors


def _read_index(model_dir: str) -> dict[str, str]:
    """weight_map of the index: tensor name -> shard file name."""
    index = os.path.join(model_dir, SAFETENSORS_INDEX)
    try:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError) as err:
        raise CheckpointError(f"{index}: expected a safetensors index with weight_map, found an unreadable file "
                              f"({type(err).__name__})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index}: expected a 'weight_map' object of tensor name -> file, found "
                              f"{type(weight_map).__name__}")
    return weight_map


class HFCheckpoint:
    """The safetensors weights of an HF directory, opened lazily: ``files`` (tensor name -> file) and
    ``shapes`` (tensor name -> shape) come from the headers; ``get`` and ``slice`` read one tensor."""

    def __init__(self, model_dir: str):
        self.path = model_dir
        index, single = os.path.join(model_dir, SAFETENSORS_INDEX), os.path.join(model_dir, SAFETENSORS_SINGLE)
        if os.path.isfile(index):
            weight_map = _read_index(model_dir)
            headers = {}
            for file in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(model_dir, file)):
                    raise CheckpointError(f"HF checkpoint {model_dir}: expected shard {file} (named by "
                                          f"{SAFETENSORS_INDEX}), found it missing")
                headers[file] = read_safetensors_header(os.path.join(model_dir, file))
            for name, file in weight_map.items():
                if name not in headers[file]:
                    raise CheckpointError(f"{os.path.join(model_dir, file)}: expected tensor {name} (named by "
                                          f"{SAFETENSORS_INDEX}), found it missing")
            self.files = {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
            self.shapes = {name: headers[file][name]["shape"] for name, file in weight_map.items()}
        elif os.path.isfile(single):
            header = read_safetensors_header(single)
            self.files = {name: single for name in header}
            self.shapes = {name: entry["shape"] for name, entry in header.items()}
        else:
            raise CheckpointError(f"HF checkpoint {model_dir}: expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}, "
                                  "found neither")
        self._handles: dict[str, Any] = {}  # file -> open safe_open, for slices; unmapped with this object

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _check(self, name: str, shape: tuple | None) -> None:
        if name not in self.files:
            raise CheckpointError(f"HF checkpoint {self.path}: expected tensor {name}, found it missing")
        if shape is not None and self.shapes[name] != tuple(shape):
            raise CheckpointError(f"HF checkpoint {self.path}: {name} expected shape {tuple(shape)}, "
                                  f"found {self.shapes[name]}")

    def get(self, name: str, shape: tuple | None = None) -> torch.Tensor:
        """The whole tensor ``name`` (of ``shape`` when given), read from its file alone."""
        from safetensors import safe_open

        self._check(name, shape)
        with safe_open(self.files[name], framework="pt") as fh:  # opened per tensor: nothing stays mapped
            return fh.get_tensor(name)

    def slice(self, name: str, shape: tuple | None = None):
        """A lazy view of ``name``: indexing it (``[a:b]``, ``[:, a:b]``) reads only those elements."""
        from safetensors import safe_open

        self._check(name, shape)
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_slice(name)


def model_dir_problem(model_dir: str) -> str | None:
    """None when an HF directory's weights are whole (or it has none: a seeded init), else one line saying
    what is wrong: for checks before any rank starts."""
    if not has_hf_weights(model_dir):
        return None
    try:
        HFCheckpoint(model_dir)
    except CheckpointError as err:
        return str(err)
    return None


# ----------------------------------------------------------------------------- writing
def write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """One safetensors file (8-byte header length, JSON header, raw little-endian data), written from
    the tensors' own memory: no serialised copy of the file is built first."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise HFWriteError(f"{name}: expected one of the safetensors dtypes, found {tensor.dtype}")
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
            raise HFWriteError(f"max_shard_bytes: expected a positive size, found {max_shard_bytes}")
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
            raise HFWriteError(f"HF export: expected each tensor name once, found {name} twice")
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
        # A name no loader looks for until close() renames it.
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


def replace_dir(staging: str, out_dir: str) -> None:
    """Move the finished ``staging`` directory to ``out_dir``, replacing a previous one."""
    old = f"{out_dir}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out_dir):
        os.rename(out_dir, old)
    os.rename(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _staging_prefix(out_dir: str) -> str:
    # The host in the name: on a shared file system a pid says nothing about another node's writers.
    return f"{out_dir}.tmp-{socket.gethostname()}-"


def clean_stale_staging(out_dir: str) -> list[str]:
    """Remove the staging directories of ``out_dir`` that writers on this host left when killed (their pid no
    longer runs, or is this process's own); a live writer's, and another host's, are left alone. Returns what
    was removed."""
    prefix = _staging_prefix(out_dir)
    parent, name_prefix = os.path.dirname(prefix), os.path.basename(prefix)
    removed = []
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        pid = name[len(name_prefix):]
        if name.startswith(name_prefix) and pid.isdigit() and (int(pid) == os.getpid() or not pid_running(int(pid))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(os.path.join(parent, name))
    if removed:
        logger.warning("HF export: removed staging left by an interrupted write: %s", ", ".join(removed))
    return removed


def write_hf_dir(out_dir: str, tensors: Iterable[tuple[str, torch.Tensor]], hf_config: dict,
                 tokenizer: Any | None = None, generation: dict | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, replace: bool = True) -> str:
    """Stream ``tensors`` into safetensors shards, then config.json (``torch_dtype`` = the tensors'
    floating dtype), the tokenizer's files and generation_config.json (``generation``, when given), in
    a staging directory renamed to ``out_dir``; ``replace`` False refuses an existing ``out_dir``."""
    out_dir = os.path.abspath(out_dir)
    if not replace and os.path.exists(out_dir):
        raise OutputExistsError(f"--out: expected a path that does not exist yet, found {out_dir}")
    clean_stale_staging(out_dir)
    staging = f"{_staging_prefix(out_dir)}{os.getpid()}"
    try:
        writer = ShardedSafetensorsWriter(staging, max_shard_bytes)
        for name, tensor in tensors:
            writer.add(name, tensor)
            del tensor  # the writer holds it only until its shard is written
        writer.close()
        config = dict(hf_config)
        if writer.dtype is not None:
            config["torch_dtype"] = str(writer.dtype).removeprefix("torch.")
        with open(os.path.join(staging, CONFIG_FILE), "w", encoding="utf-8") as fh:
            json.dump(config, fh, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if generation is not None:
            with open(os.path.join(staging, GENERATION_CONFIG_FILE), "w", encoding="utf-8") as fh:
                json.dump(generation, fh, indent=2)
        fsync_tree(staging)  # written out before the rename publishes it: a node crash leaves no zero-filled files
        if replace:
            replace_dir(staging, out_dir)
        else:
            os.rename(staging, out_dir)
        fsync_path(os.path.dirname(out_dir))
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written is left behind
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            raise DiskFullError(f"HF export {out_dir} not written: {os.strerror(err.errno)} writing "
                                f"{err.filename or 'a file'}; nothing of it was kept") from None
        raise
    return out_dir
