"""Each agent trajectory's K/V kept across its turns on the native engine (``rollout.enable_prefix_caching``).

An agent turn's prompt is the trajectory so far: the previous turn's prompt, the tokens the model sampled there,
then the tool's (or user's) delta. The K/V of every token the previous engine call fed through the model (its
prompt and its sampled tokens but the last) is kept here under the trajectory's ``request_id``; the next turn of
that trajectory prefills only from where its kept prefix ends. Kept K/V is per TP rank (each rank its own heads),
in the engine's dtype, on its device.

It is dropped when the weights change (a new version, or an interrupt: the asynchronous trainers' pause) and, least
recently used first, when the kept tokens pass ``max_tokens``: a budget in tokens, not bytes, so every rank of a TP
group (holding a share of the heads) makes the same choices from the same calls.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class PrefixCache:
    """``request_id`` -> (the token ids whose K/V is kept, K, V) with K/V [layers, kv_heads, tokens, head_dim]."""

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self._entries: OrderedDict[str, tuple[list[int], torch.Tensor, torch.Tensor]] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, key: str, ids: list[int]) -> int:
        """How many leading tokens of ``ids`` have kept K/V under ``key`` (0: none, or not a prefix of ``ids``)."""
        entry = self._entries.get(key)
        if entry is None:
            return 0
        kept = entry[0]
        return len(kept) if len(kept) <= len(ids) and ids[:len(kept)] == kept else 0

    def get(self, key: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of the first ``length`` kept tokens of ``key`` (views)."""
        _, keys, values = self._entries[key]
        self._entries.move_to_end(key)
        return keys[:, :, :length], values[:, :, :length]

    def put(self, key: str, ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep ``ids``' K/V under ``key`` (replacing what it had), then drop the least recently used entries
        until the budget holds (an entry alone larger than the budget is not kept)."""
        if keys.shape[2] != len(ids):
            raise RuntimeError(f"prefix cache: expected K/V of {len(ids)} tokens for {key}, found {keys.shape[2]}")
        self.drop(key)
        self._entries[key] = (list(ids), keys, values)
        self.tokens += len(ids)
        while self.tokens > self.max_tokens and self._entries:
            self.drop(next(iter(self._entries)))

    def drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.tokens -= len(entry[0])

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0
