"""A parallel layout chosen from the model's size, the ranks and the memory per device, for a run that names none.

The Python API (``TrainerConfig`` / ``DataPipeline``) calls :func:`choose_layout` when the user's keys name no
layout (:data:`LAYOUT_KEYS`); a layout the user names always wins and nothing is chosen. The rule:

1. **rollout TP**: the smallest tp (a power of two within a node, dividing the attention heads and the MLP width)
   whose rollout weights take at most half of the rollout's share of the device (``rollout.gpu_memory_utilization``;
   the other half is for the KV cache);
2. a **small** model (dense, at most :data:`SMALL_MAX_PARAMS`) trains with **data-parallel FSDP** (weights,
   gradients and Adam state sharded over every rank) when its per-rank state plus the rollout's weights fit in the
   usable memory (:data:`USABLE_FRACTION` of the device; the rest is for activations, the KV cache and allocator
   slack, which the estimator does not count); else with **FSDP + CPU offload** (the state in host memory; the
   device holds the rollout's weights and the gathered weights of the FSDP units being computed) when the host
   holds the node's state; on a machine without an accelerator the device *is* host memory and offload is never
   chosen; else as a large model;
3. a **large** model (or an MoE: experts need Megatron's expert parallelism) trains with **Megatron**: the fewest
   model-parallel ranks tp*pp (at equal size tp, within a node, before pp: no pipeline bubble), then (MoE) the
   smallest ep, whose per-rank estimate
   (:func:`verl.models.memory.estimate_rank_memory`, distributed optimizer) plus the rollout's weights fits; a
   dense large model that no Megatron layout fits falls back to FSDP + offload;
4. nothing fits: an :class:`~verl.errors.InputError` naming the smallest footprint found and the device's memory.

Memory per device: the accelerator's (``torch.cuda``), or host memory / ranks per node on CPU; a test (or a user
planning a larger machine) passes ``device_memory`` instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.errors import InputError
from verl.models.config import ModelConfig
from verl.models.memory import GiB, estimate_rank_memory

ARR = "actor_rollout_ref"
# Keys that name a parallel layout: when the user sets any, the chooser stays out.
LAYOUT_KEYS = (
    "model_engine",
    f"{ARR}.actor.strategy",
    f"{ARR}.actor.megatron.tensor_model_parallel_size",
    f"{ARR}.actor.megatron.pipeline_model_parallel_size",
    f"{ARR}.actor.megatron.expert_model_parallel_size",
    f"{ARR}.actor.fsdp_config.param_offload",
    f"{ARR}.actor.fsdp_config.offload_policy",
    f"{ARR}.actor.fsdp_config.optimizer_offload",
    f"{ARR}.actor.fsdp_config.fsdp_size",
    f"{ARR}.rollout.tensor_model_parallel_size",
)
USABLE_FRACTION = 0.75        # of the device, for the estimated state (weights, grads, Adam, rollout weights)
SMALL_MAX_PARAMS = 8e9        # a dense model up to this size trains with FSDP (offloaded if it must)
ROLLOUT_KV_SHARE = 0.5        # of the rollout's share of the device, left to the KV cache
DEFAULT_ROLLOUT_UTILIZATION = 0.5  # the packaged rollout.gpu_memory_utilization


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    engine: str                # "fsdp" or "megatron"
    offload: bool              # FSDP's CPU offload
    tp: int                    # Megatron's (1 for FSDP)
    pp: int
    ep: int
    dp: int
    rollout_tp: int
    per_rank_bytes: int        # the estimated device memory of the chosen layout
    device_memory: int
    reasons: tuple[str, ...]

    @property
    def overrides(self) -> dict[str, Any]:
        """The chosen layout as verl's keys (dotted)."""
        keys: dict[str, Any] = {"model_engine": "dp" if self.engine == "fsdp" else "megatron",
                                f"{ARR}.rollout.tensor_model_parallel_size": self.rollout_tp}
        if self.engine == "fsdp":
            for key in ("param_offload", "optimizer_offload"):
                keys[f"{ARR}.actor.fsdp_config.{key}"] = self.offload
        else:
            keys[f"{ARR}.actor.megatron.tensor_model_parallel_size"] = self.tp
            keys[f"{ARR}.actor.megatron.pipeline_model_parallel_size"] = self.pp
            if self.ep > 1:
                keys[f"{ARR}.actor.megatron.expert_model_parallel_size"] = self.ep
        return keys

    def describe(self) -> str:
        """The choice and why, one block (one ``[layout]`` line each)."""
        if self.engine == "fsdp":
            head = f"data-parallel FSDP{' with CPU offload' if self.offload else ''}"
        else:
            head = f"Megatron tp={self.tp} pp={self.pp}{f' ep={self.ep}' if self.ep > 1 else ''} dp={self.dp}"
        lines = [f"no parallel layout named: chose {head}, rollout tp={self.rollout_tp}", *self.reasons,
                 "a layout you name wins (model_engine, actor.megatron.tensor/pipeline_model_parallel_size, "
                 "actor.fsdp_config.param_offload, rollout.tensor_model_parallel_size)"]
        return "\n".join(f"[layout] {line}" for line in lines)


def names_layout(keys: Mapping[str, Any]) -> list[str]:
    """The layout keys among ``keys`` (dotted verl keys, e.g. a config tree flattened)."""
    return [k for k in LAYOUT_KEYS if k in keys]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _divisors_pow2(limit: int) -> list[int]:
    out, t = [], 1
    while t <= limit:
        out.append(t)
        t *= 2
    return out


def _layer_and_embedding_params(model: ModelConfig, total: int) -> tuple[int, int]:
    embedding = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    return max(0, total - embedding) // max(1, model.num_hidden_layers), embedding


def detect_device_memory(ranks_per_node: int) -> tuple[int, bool, str]:
    """(bytes per device, whether it is an accelerator, where the number comes from)."""
    import torch

    from verl.utils.device import is_cuda_available

    if is_cuda_available():
        total = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        return total, True, f"{torch.cuda.get_device_name(0)}"
    import psutil

    host = psutil.virtual_memory().total
    return host // max(1, ranks_per_node), False, f"host memory {_gib(host)} / {ranks_per_node} ranks"


def host_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def choose_layout(model: ModelConfig, world: int, *, ranks_per_node: int | None = None,
                  device_memory: int | None = None, accelerator: bool | None = None,
                  host_memory_bytes: int | None = None, dtype_bytes: int = 4,
                  rollout_utilization: float = DEFAULT_ROLLOUT_UTILIZATION) -> LayoutChoice:
    """The layout for ``model`` on ``world`` ranks (see the module's docstring). ``device_memory`` (bytes) and
    ``accelerator`` default to this machine's; ``dtype_bytes``: the training and rollout dtype's size."""
    if not isinstance(world, int) or world < 1:
        raise InputError(f"choose_layout: expected a positive number of ranks, found {world!r}")
    per_node = min(world, ranks_per_node or world)
    source = "given"
    if device_memory is None:
        device_memory, detected_accel, source = detect_device_memory(per_node)
        accelerator = detected_accel if accelerator is None else accelerator
    accelerator = bool(accelerator)
    usable = int(device_memory * USABLE_FRACTION)
    whole = estimate_rank_memory(model, tp=1, pp=1, dp=1, dtype_bytes=dtype_bytes, distributed_optimizer=False)
    reasons = [f"model {model.model_type}: {whole.params / 1e9:.2f}B params, {dtype_bytes}-byte weights; {world} "
               f"ranks ({per_node} per node); {_gib(device_memory)} per device ({source}); usable for the "
               f"estimated state: {_gib(usable)} ({USABLE_FRACTION:.0%}, the rest for activations and KV cache)"]

    # 1. rollout tp
    rollout_budget = device_memory * rollout_utilization * ROLLOUT_KV_SHARE
    rollout_tp = None
    for t in _divisors_pow2(per_node):
        if world % t or model.num_attention_heads % t or model.intermediate_size % t or \
                (model.is_moe and model.moe_intermediate_size % t):
            continue
        if whole.rollout_bytes / t <= rollout_budget:
            rollout_tp = t
            break
    if rollout_tp is None:
        raise InputError(f"layout: expected the rollout's weights to fit in {_gib(rollout_budget)} per device "
                         f"(half of rollout.gpu_memory_utilization={rollout_utilization}) at some tp <= {per_node}, "
                         f"found {_gib(whole.rollout_bytes / max(_divisors_pow2(per_node)))} at the largest")
    rollout = whole.rollout_bytes // rollout_tp
    reasons.append(f"rollout tp={rollout_tp}: the smallest whose weights ({_gib(rollout)} per rank) fit in half of "
                   f"the rollout's {rollout_utilization:.0%} share ({_gib(rollout_budget)})")

    small = whole.params <= SMALL_MAX_PARAMS and not model.is_moe
    size = (f"{whole.params / 1e9:.2f}B params <= {SMALL_MAX_PARAMS / 1e9:.0f}B, dense: a small model"
            if small else f"{whole.params / 1e9:.2f}B params{' (MoE)' if model.is_moe else ''}: a large model")

    # FSDP, every rank a DP rank; with CPU offload
    fsdp_state = whole.training_bytes // world
    fsdp_need = fsdp_state + rollout
    layer, embedding = _layer_and_embedding_params(model, whole.params)
    offload_need = rollout + 2 * max(layer, embedding) * dtype_bytes  # the unit computed + the one prefetched
    host = host_memory_bytes if host_memory_bytes is not None else (host_memory() if accelerator else 0)
    node_state = whole.training_bytes * per_node // world
    offload_ok = accelerator and not model.is_moe and offload_need <= usable and node_state <= 0.8 * host
    why_not_offload = ("no accelerator: the device is host memory, offload moves nothing" if not accelerator else
                       "MoE experts are trained with Megatron's expert parallelism" if model.is_moe else
                       f"its device need {_gib(offload_need)} > {_gib(usable)}" if offload_need > usable else
                       f"the node's offloaded state {_gib(node_state)} > 80% of host memory {_gib(host)}"
                       if not offload_ok else "")

    def fsdp(offload: bool, why: str) -> LayoutChoice:
        return LayoutChoice("fsdp", offload, 1, 1, 1, world, rollout_tp, offload_need if offload else fsdp_need,
                            device_memory, tuple([*reasons, why]))

    offload_why = (f"FSDP with CPU offload: the device holds the rollout {_gib(rollout)} + two gathered units "
                   f"{_gib(2 * max(layer, embedding) * dtype_bytes)} = {_gib(offload_need)} <= {_gib(usable)}; the "
                   f"host holds the node's state {_gib(node_state)} of {_gib(host)}")
    if small:
        reasons.append(size + ": data-parallel FSDP first")
        if fsdp_need <= usable:
            return fsdp(False, f"FSDP over {world} ranks: state {_gib(whole.training_bytes)} / {world} = "
                               f"{_gib(fsdp_state)} + rollout {_gib(rollout)} = {_gib(fsdp_need)} <= {_gib(usable)}: "
                               "fits without offload")
        reasons.append(f"FSDP without offload needs {_gib(fsdp_need)} per rank (state {_gib(fsdp_state)} + rollout "
                       f"{_gib(rollout)}) > {_gib(usable)}")
        if offload_ok:
            return fsdp(True, offload_why)
        reasons.append(f"FSDP with CPU offload: not possible ({why_not_offload}); Megatron next")
    else:
        reasons.append(size + ": Megatron model parallelism (FSDP's per-layer gathers and offload traffic grow "
                       "with the model)")

    best = _megatron(model, world, per_node, dtype_bytes, rollout_tp, usable, reasons)
    if isinstance(best, LayoutChoice):
        return dataclasses.replace(best, device_memory=device_memory)
    if not small and offload_ok:
        return fsdp(True, f"no Megatron layout fits (the smallest needs {_gib(best[-1])}); " + offload_why)
    found = (f"{_gib(best[-1])} at Megatron tp={best[0]} pp={best[1]} ep={best[2]}" if best
             else f"{_gib(fsdp_need)} with FSDP")
    raise InputError(f"layout: expected a layout whose estimated state fits in {_gib(usable)} per device "
                     f"({USABLE_FRACTION:.0%} of {_gib(device_memory)}) on {world} ranks, found {found} at best "
                     f"(add ranks or name a layout yourself)")


def _megatron(model: ModelConfig, world: int, per_node: int, dtype_bytes: int, rollout_tp: int, usable: int,
              reasons: list[str]) -> Any:
    """The first Megatron layout that fits, by tp (within a node), then pp, then ep (MoE): a LayoutChoice; or,
    when none fits, (tp, pp, ep, bytes) of the smallest footprint (None when no layout divides the model)."""
    from verl.models.mcore.model import ModelLayoutError, check_parallel_layout

    layouts = [(tp, pp) for tp in _divisors_pow2(per_node) for pp in range(1, model.num_hidden_layers + 1)
               if world % (tp * pp) == 0 and model.num_hidden_layers % pp == 0]
    layouts.sort(key=lambda tp_pp: (tp_pp[0] * tp_pp[1], tp_pp[1]))  # fewest model-parallel ranks; tp before pp
    best: tuple[int, int, int, int] | None = None
    for tp, pp in layouts:
        for ep in _divisors_pow2(world // pp) if model.is_moe else [1]:
            try:
                check_parallel_layout(model, tp, pp, ep, world_size=world)
            except ModelLayoutError:
                continue
            dp = world // (tp * pp)
            est = estimate_rank_memory(model, tp=tp, pp=pp, dp=dp, ep=ep, dtype_bytes=dtype_bytes,
                                       rollout_tp=rollout_tp)
            need = est.training_bytes + est.rollout_bytes
            if best is None or need < best[-1]:
                best = (tp, pp, ep, need)
            if need <= usable:
                reasons.append(f"Megatron: the fewest model-parallel ranks tp*pp (tp, within a node, before pp"
                               f"{'; then ep' if model.is_moe else ''}) that fit: tp={tp} pp={pp}"
                               f"{f' ep={ep}' if model.is_moe else ''} dp={dp}: {_gib(est.training_bytes)} training "
                               f"state (distributed optimizer) + rollout {_gib(est.rollout_bytes)} = {_gib(need)} "
                               f"<= {_gib(usable)}")
                return LayoutChoice("megatron", False, tp, pp, ep, dp, rollout_tp, need, 0, tuple(reasons))
    return best
