"""Where a weight sync reads the actor's weights, chosen once for both destinations (the colocated rollout
engine through :class:`~verl.hybrid_engine.hybrid_engine.HybridEngine`, a standalone pool through
:class:`~verl.workers.rollout_pool.RolloutPoolLink`).

The training engine's contract (:class:`verl.engine.base.TrainingEngine`) offers three shapes:

* ``lora_sync_source`` (LoRA with ``lora.merge=false``): the frozen base by name at the first sync, then the
  adapters alone (:mod:`verl.hybrid_engine.lora_sync`);
* ``bind_reshard`` returns ``(flat, offsets)``: one buffer the weights are views of, bound once, which the copy
  programs address by offset;
* otherwise the local shards by name at every sync (``reshard_sources``: FSDP2's shards, Megatron's when the
  distributed optimizer keeps dense and expert parameters apart, merged LoRA weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

NamedSources = Callable[[torch.dtype, "torch.device | str"], dict[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class ActorWeights:
    """One of: ``bound`` (flat buffer and the offsets of its tensors), or ``named`` (a function of the
    destination's dtype and device returning the local shards by HF name); ``lora`` is the adapter source when
    the adapters travel alone (``named`` then reads the base)."""

    bound: tuple[torch.Tensor, Any] | None
    named: NamedSources | None
    lora: Any = None


def actor_weights(engine: Any, model_config: Any, training: Any) -> ActorWeights:
    """The actor engine's weights as a sync reads them (see the module doc)."""
    bound = engine.bind_reshard(model_config, training)
    lora = engine.lora_sync_source(model_config, training)
    if lora is not None:
        return ActorWeights(None, lora.base_sources, lora)
    if bound is None:
        return ActorWeights(None, engine.reshard_sources)
    return ActorWeights(bound, None)
