"""Is a safetensors file whole? Its header names every tensor's byte range; a cut file is shorter.

Reads only the 8-byte length and the JSON header, so checking a multi-GB checkpoint costs nothing.
"""

from __future__ import annotations

import json
import os
import struct

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the header


def safetensors_problem(path: str) -> str | None:
    """None when ``path`` is a complete safetensors file, else one line saying what is wrong."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{path}: expected a safetensors file, found {size} bytes"
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                return f"{path}: expected a safetensors header of {header_len} bytes, found a {size}-byte file"
            header = json.loads(fh.read(header_len))
    except OSError as err:
        return f"{path}: expected a readable safetensors file, found {err.strerror}"
    except (ValueError, UnicodeDecodeError):
        return f"{path}: expected a safetensors JSON header, found unreadable bytes"
    if not isinstance(header, dict):
        return f"{path}: expected a safetensors JSON header, found {type(header).__name__}"
    end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        return f"{path}: expected {8 + header_len + end} bytes (its header's tensors), found {size} (cut file)"
    return None


def model_dir_problem(model_dir: str) -> str | None:
    """Every safetensors file of an HF model directory (single file or sharded index) is whole."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"{index}: expected a safetensors index with weight_map, found an unreadable file " \
                   f"({type(err).__name__})"
    else:
        files = [name for name in sorted(os.listdir(model_dir)) if name.endswith(".safetensors")]
    for name in files:
        problem = safetensors_problem(os.path.join(model_dir, name))
        if problem is not None:
            return problem
    return None
