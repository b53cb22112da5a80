"""Where a rank computes: one rule for every engine, role and CLI (names follow verl's verl.utils.device).

The current CUDA device when torch sees one (the bootstrap pins each local rank to its GPU with
``torch.cuda.set_device``), else the CPU. ``VERL_DEVICE=cpu`` forces the CPU on a GPU machine.
The process-group backend is chosen separately (``dist_backend``): NCCL needs one GPU per rank, so
ranks that share a GPU (or run on CPU) use gloo, which also moves CUDA tensors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from verl.errors import InputError

DEVICE_ENV = "VERL_DEVICE"


def is_cuda_available() -> bool:
    """CUDA usable here and not switched off with VERL_DEVICE=cpu."""
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise InputError(f"{DEVICE_ENV}: expected 'cpu' or 'cuda', found {forced!r}")
    if forced == "cpu":
        return False
    available = torch.cuda.is_available()
    if forced == "cuda" and not available:
        raise InputError(f"{DEVICE_ENV}=cuda: expected a CUDA device, found none")
    return available


def visible_gpu_count() -> int:
    """CUDA devices torch sees, whatever VERL_DEVICE says: what ``verl check-env`` reports about the hardware."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def get_device_name() -> str:
    """``"cuda"`` or ``"cpu"``."""
    return "cuda" if is_cuda_available() else "cpu"


def get_device_id() -> int:
    """Index of this rank's current CUDA device (0 on CPU)."""
    return torch.cuda.current_device() if is_cuda_available() else 0


def get_device() -> torch.device:
    """The device this rank computes on: its current CUDA device, else the CPU."""
    return torch.device("cuda", get_device_id()) if is_cuda_available() else torch.device("cpu")


def dist_backend(local_world_size: int) -> str:
    """``"nccl"`` when every local rank has a GPU of its own, else ``"gloo"``."""
    if is_cuda_available() and local_world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` on ``device`` (a no-op for tensors already there)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
