"""Offload and onload: a training engine's state leaves device memory while another phase needs it.

HybridFlow colocates the actor's training state with the rollout on the same devices; while the rollout
generates, the actor's parameters, gradients and Adam state only take memory. :class:`StateOffload` copies
the bytes of each distinct storage behind a set of tensors into host memory (pinned on CUDA) and shrinks the
storage to zero bytes; :meth:`StateOffload.onload` grows it back and copies the bytes in. The tensors
themselves are never replaced, so every view of a storage (Megatron's parameters and ``main_grad`` inside
its contiguous buffers, FSDP2's sharded DTensors, tied embeddings) and every reference to it (optimizer
param groups, DDP hooks) stays valid: the model does not know it was away. On a CPU device the copy is a
host-to-host copy, and the shrunk storages still prove the bytes left (what the tests check).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a parameter (a DTensor's shard, else the tensor itself)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


class StateOffload:
    """The storages behind some tensors, held in host memory until :meth:`onload`."""

    def __init__(self):
        # (storage, its host copy, its byte size), in the order they left
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor, int]] = []

    @property
    def offloaded_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self._held)

    def holds(self, storage: torch.UntypedStorage) -> bool:
        return any(s._cdata == storage._cdata for s, _, _ in self._held)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move the storages behind ``tensors`` (each distinct storage once; ones already held are
        skipped) to host memory; returns the bytes moved."""
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if t is None:
                continue
            storage = local_tensor(t).untyped_storage()
            if storage.nbytes() and not self.holds(storage):
                storages.setdefault(storage._cdata, storage)
        moved = 0
        for storage in storages.values():
            nbytes = storage.nbytes()
            pin = storage.device.type == "cuda"
            host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_bytes_of(storage))
            storage.resize_(0)  # the device memory is free from here
            self._held.append((storage, host, nbytes))
            moved += nbytes
        return moved

    def onload(self) -> int:
        """Every held storage back at its size with its bytes; returns the bytes moved."""
        moved = 0
        for storage, host, nbytes in self._held:
            storage.resize_(nbytes)
            _bytes_of(storage).copy_(host, non_blocking=False)
            moved += nbytes
        self._held.clear()
        return moved


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def optimizer_tensors(optimizer: torch.optim.Optimizer, model_storages: set[int]) -> list[torch.Tensor]:
    """Every tensor of a torch optimizer's state, plus the parameters it updates that are not the model's
    own (Megatron's fp32 main copies of bf16 parameters)."""
    out = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for group in optimizer.param_groups:
        out += [p for p in group["params"] if local_tensor(p).untyped_storage()._cdata not in model_storages]
    return out
