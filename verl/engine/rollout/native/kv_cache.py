"""Preallocated key/value cache: [layers, batch, kv_heads_per_rank, max_len, head_dim] for K and V.

Allocated once per shape growth and reused across requests; a request takes views of the first
``batch`` rows and ``max_len`` slots, and decoding writes one slot per step in place.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.keys = self.values = None

    @property
    def capacity(self) -> tuple[int, int]:
        """(batch, max_len) the current allocation can hold; (0, 0) when nothing is allocated."""
        return (0, 0) if self.keys is None else (self.keys.shape[1], self.keys.shape[3])

    def reserve(self, batch: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [layers, batch, kv_heads, max_len, head_dim] of K and V, growing the allocation if needed."""
        have_batch, have_len = self.capacity
        if batch > have_batch or max_len > have_len:
            shape = (self.num_layers, max(batch, have_batch), self.kv_heads, max(max_len, have_len), self.head_dim)
            self.keys = self.values = None  # free the old allocation before taking the new one
            self.keys = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.values = torch.empty(shape, dtype=self.dtype, device=self.device)
        return (self.keys.narrow(1, 0, batch).narrow(3, 0, max_len),
                self.values.narrow(1, 0, batch).narrow(3, 0, max_len))

    def release(self) -> None:
        self.keys = self.values = None
