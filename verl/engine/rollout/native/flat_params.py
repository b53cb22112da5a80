"""One flat per-rank buffer holding every rollout-layout tensor, and named views into it.

The hybrid engine reshards straight into ``flat`` (offsets follow ``rollout_param_specs`` order,
no gaps), so the views the model reads see new weights with no copy. ``release`` drops the storage
while keeping the views; ``resume`` re-allocates it (contents undefined until written again).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from verl.models.rollout_shapes import RolloutParamSpec


class FlatParams:
    def __init__(self, specs: list[RolloutParamSpec], dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.specs = list(specs)
        self.offsets: dict[str, int] = {}
        offset = 0
        for spec in self.specs:
            self.offsets[spec.name] = offset
            offset += spec.numel
        self.numel = offset
        self.flat = torch.empty(self.numel, dtype=dtype, device=device)
        self.views: dict[str, torch.Tensor] = {
            spec.name: self.flat.narrow(0, self.offsets[spec.name], spec.numel).view(spec.shape)
            for spec in self.specs
        }
        self._nbytes = self.flat.untyped_storage().nbytes()

    @property
    def released(self) -> bool:
        return self.flat.untyped_storage().nbytes() == 0

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (name, tensor) into its view; shapes must match the rollout layout exactly."""
        if self.released:
            raise RuntimeError("rollout weights: expected resumed memory, found it released; call resume() first")
        for name, tensor in named_tensors:
            view = self.views.get(name)
            if view is None:
                raise KeyError(f"rollout weights: expected a name of the rollout layout, found {name!r}")
            if tuple(tensor.shape) != tuple(view.shape):
                raise ValueError(f"rollout weight {name}: expected shape {tuple(view.shape)}, "
                                 f"found {tuple(tensor.shape)}")
            view.copy_(tensor)

    def swap(self, flat: torch.Tensor) -> torch.Tensor:
        """Make ``flat`` (same size, dtype and device) the weights, in place of the current buffer, which is
        returned: every view is rebound to the new storage, so whoever holds a view reads the new weights."""
        if flat.dim() != 1 or flat.numel() != self.numel or flat.dtype != self.flat.dtype \
                or flat.device != self.flat.device or not flat.is_contiguous():
            raise ValueError(f"rollout weights: expected a contiguous 1-D {self.flat.dtype} buffer of {self.numel} "
                             f"elements on {self.flat.device}, found {flat.dtype} shape {tuple(flat.shape)} on "
                             f"{flat.device}")
        old = self.flat
        storage, base = flat.untyped_storage(), flat.storage_offset()
        with torch.no_grad():
            for spec in self.specs:
                view = self.views[spec.name]
                view.set_(storage, base + self.offsets[spec.name], view.shape, view.stride())
        self.flat = flat
        self._nbytes = storage.nbytes()
        return old

    def release(self) -> None:
        self.flat.untyped_storage().resize_(0)

    def resume(self) -> None:
        if self.released:
            self.flat.untyped_storage().resize_(self._nbytes)
