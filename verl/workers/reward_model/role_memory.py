"""What each model of a PPO job holds in memory (issue 47, item 4: the four models' memory in the summary).

``memory/{actor,ref,critic,reward_model,rollout}_gb``: the bytes of the distinct tensor storages each model holds on
a rank (parameters, gradients, Megatron's ``main_grad`` buffers, optimizer states; the rollout's weight buffer and KV
cache; a judge's weights while awake and ``memory/reward_model_awake_gb`` its size when serving), the max over ranks.
A storage shared by two roles (a reference that is the actor with its adapters off) counts once, for the first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

GIB = 1024 ** 3


def _storages(tensors: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None or not hasattr(tensor, "untyped_storage"):
            continue
        local = getattr(tensor, "_local_tensor", None)  # a DTensor: this rank's shard
        storage = (local if local is not None else tensor).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def engine_tensors(engine: Any) -> list[Any]:
    """A training engine's parameters, gradients and optimizer states."""
    modules = engine.module if isinstance(engine.module, list | tuple) else [engine.module]
    out = []
    for module in modules:
        for param in module.parameters():
            out += [param, param.grad, getattr(param, "main_grad", None)]
    for optimizer in engine.torch_optimizers():
        for state in optimizer.state.values():
            out += [v for v in state.values() if hasattr(v, "untyped_storage")]
    return out


def local_role_memory(trainer: Any) -> dict[str, float]:
    """This rank's ``memory/*_gb`` of the trainer's worker groups (keys only for the roles the job runs)."""
    seen: set[int] = set()
    out: dict[str, float] = {}
    arr = getattr(getattr(trainer, "actor_rollout_wg", None), "worker", None)
    if arr is not None:
        actor = getattr(arr, "actor", None)
        if actor is not None:
            out["memory/actor_gb"] = _storages(engine_tensors(actor.engine), seen) / GIB
        ref = getattr(arr, "ref", None)
        if ref is not None:
            out["memory/ref_gb"] = _storages(engine_tensors(ref.engine), seen) / GIB
        rollout = arr.rollout_side.resident_tensors()
        if rollout is not None:
            out["memory/rollout_gb"] = _storages(rollout, seen) / GIB
    critic = getattr(getattr(trainer, "critic_wg", None), "worker", None)
    if critic is not None and getattr(critic, "critic", None) is not None:
        out["memory/critic_gb"] = _storages(engine_tensors(critic.critic.engine), seen) / GIB
    rm_worker = getattr(getattr(trainer, "rm_wg", None), "worker", None)
    if rm_worker is not None and rm_worker.rm is not None:
        rm = rm_worker.rm
        if hasattr(rm, "resident_bytes"):  # a judge: what it holds now (0 asleep) and when serving
            out["memory/reward_model_gb"] = rm.resident_bytes() / GIB
            out["memory/reward_model_awake_gb"] = rm.weight_bytes / GIB
        elif hasattr(rm, "engine"):
            out["memory/reward_model_gb"] = _storages(engine_tensors(rm.engine), seen) / GIB
        else:  # transformers' module on every rank
            out["memory/reward_model_gb"] = _storages(rm.model.parameters(), seen) / GIB
    return out
