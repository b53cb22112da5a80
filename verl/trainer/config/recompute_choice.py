"""Activation recompute chosen by memory where the user did not choose (issue 60 item 2).

``actor_rollout_ref.model.enable_gradient_checkpointing`` defaults to null here (verl: true): recompute costs a
second forward of every layer in the backward (~30% of the update), so it is switched on only when the actor's
update would not fit without it. The estimate per training rank: the state (weights, gradients, Adam, the
colocated rollout's copy: :mod:`verl.models.memory`) plus one micro-batch's activations
(:mod:`verl.models.activation_memory`), against 90% of the memory a rank has:

- ``VERL_DEVICE_MEMORY_GIB`` when set (as for the automatic layout);
- else a GPU host's smallest GPU as ``nvidia-smi`` reports it (no CUDA context is created for this);
- else the host's memory shared by its ``trainer.n_gpus_per_node`` ranks.

The inputs are the config and the node's total memory, not what is free now, so every rank of a job on identical
nodes takes the same decision (Megatron's recompute replays tensor-parallel collectives: the ranks must agree).
The local launcher decides once and hands the choice to its ranks as an override. A user's explicit value wins,
as does ``override_transformer_config.recompute_granularity``. Outside `verl train` (a trainer the Python API
builds) a null value stays off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

KEY = "actor_rollout_ref.model.enable_gradient_checkpointing"
USABLE_FRACTION = 0.9


def rank_memory_bytes(ranks_per_node: int) -> tuple[int, str]:
    """(the memory one training rank has, where the figure comes from)."""
    from verl.trainer.config.auto_layout import DEVICE_MEMORY_ENV, _device_memory

    given = _device_memory()
    if given is not None:
        return given, f"{DEVICE_MEMORY_ENV}={os.environ[DEVICE_MEMORY_ENV].strip()}"
    smi = shutil.which("nvidia-smi")
    if smi and os.path.exists("/dev/nvidiactl"):
        try:
            out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            sizes = [int(float(line)) << 20 for line in out.split() if line.strip()]
        except (OSError, ValueError, subprocess.SubprocessError):
            sizes = []
        if sizes:
            return min(sizes), "the smallest GPU (nvidia-smi)"
    import psutil

    total = psutil.virtual_memory().total
    return total // max(1, ranks_per_node), f"host memory / {ranks_per_node} ranks"


def choose(cfg: Mapping[str, Any]) -> tuple[bool | None, str]:
    """(recompute on or off, one line saying why); (None, ...) when the user chose."""
    from verl.errors import InputError
    from verl.models.activation_memory import activation_bytes
    from verl.models.config import ModelConfig
    from verl.models.memory import GiB, estimate_rank_memory
    from verl.trainer.config.derived import actor_dp_size, backend_rules, model_parallel_sizes
    from verl.utils.torch_dtypes import torch_dtype

    arr = cfg["actor_rollout_ref"]
    actor = arr["actor"]
    mega = actor["megatron"]
    if arr["model"]["enable_gradient_checkpointing"] is not None:
        return None, f"[recompute] {KEY}={arr['model']['enable_gradient_checkpointing']}: your choice"
    if (mega.get("override_transformer_config") or {}).get("recompute_granularity") is not None:
        return False, ("[recompute] actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity "
                       "is set: your choice")
    try:
        model = ModelConfig.from_pretrained(arr["model"]["path"])
    except (InputError, OSError) as err:  # a checkpoint the engines read in their own way (preflight took it)
        return False, f"[recompute] off: no estimate for this checkpoint ({err})"
    tp, pp = model_parallel_sizes(cfg)
    layout = backend_rules(cfg).memory_layout(cfg)
    dtype_bytes = torch_dtype(layout.dtype).itemsize
    state = estimate_rank_memory(
        model, tp=tp, pp=pp, dp=actor_dp_size(cfg), ep=layout.ep, etp=layout.etp, dtype_bytes=dtype_bytes,
        distributed_optimizer=layout.distributed_optimizer, rollout_tp=arr["rollout"]["tensor_model_parallel_size"],
        rollout_dtype_bytes=torch_dtype(arr["rollout"]["dtype"]).itemsize)
    state_bytes = state.training_bytes + state.rollout_bytes
    seq_len = int(cfg["data"]["max_prompt_length"]) + int(cfg["data"]["max_response_length"])
    if actor["use_dynamic_bsz"] or actor["ppo_micro_batch_size_per_gpu"] is None:
        micro = max(1, int(actor["ppo_max_token_len_per_gpu"]) // seq_len)
    else:
        micro = int(actor["ppo_micro_batch_size_per_gpu"])
    kept = {on: activation_bytes(model, micro_batch=micro, seq_len=seq_len, tp=tp, pp=pp,
                                 sequence_parallel=layout.sequence_parallel,
                                 dtype_bytes=dtype_bytes, recompute=on) for on in (False, True)}
    memory, source = rank_memory_bytes(int(cfg["trainer"]["n_gpus_per_node"]))
    usable = USABLE_FRACTION * memory
    gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
    sizes = (f"state {gib(state_bytes)} + activations of a {micro} x {seq_len} micro-batch {gib(kept[False])} "
             f"without recompute, {gib(kept[True])} with; {USABLE_FRACTION:.0%} of {gib(memory)} per rank "
             f"({source})")
    if state_bytes + kept[False] <= usable:
        return False, f"[recompute] off: the update fits without it ({sizes})"
    replay = arr["actor"].get("router_replay") or {}
    if replay.get("mode") == "R3" and pp > 1:
        return False, (f"[recompute] off although the update may not fit ({sizes}): router_replay.mode=R3 with "
                       "pipeline parallelism does not run with recompute")
    fits = "" if state_bytes + kept[True] <= usable else "; it may not fit even so"
    return True, f"[recompute] on: the update does not fit without it ({sizes}){fits}"
