"""``actor_rollout_ref.rollout``: the rollout engine (a registered one: native, SGLang), its sampling and its
share of the reshard."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.engine.rollout.registry import ROLLOUT_NAME_CHOICES
from verl.utils.torch_dtypes import TRAINING_DTYPES
from verl.workers.config.section import Section, checked

frozen = dataclasses.dataclass(frozen=True)


@frozen
class ValKwargsConfig(Section):
    """``rollout.val_kwargs``: sampling for validation."""

    do_sample: bool
    temperature: float = checked(ge=0)
    top_k: int = checked(ge=-1)
    top_p: float = checked(gt=0, le=1)
    n: int = checked(ge=1)


@frozen
class EngineKwargsConfig(Section):
    """``rollout.engine_kwargs``: settings passed to the engine as they are."""

    sglang: Mapping[str, Any]


@frozen
class MultiTurnConfig(Section):
    enable: bool


@frozen
class CheckpointEngineConfig(Section):
    """``rollout.checkpoint_engine``: verl's weight-sync bucket (the 3D-HybridEngine's, here)."""

    # verl's names: naive (colocated, in process) and nccl (a standalone pool: our bridge, NCCL between GPUs and gloo
    # on CPU, whichever the key says); the transfer is the 3D-HybridEngine's either way.
    backend: str = checked(choices=("naive", "nccl"))
    update_weights_bucket_megabytes: int = checked(ge=1)
    verify: bool        # standalone pool: checksum every bucket on the rollout rank
    delta: bool         # standalone pool: sparse delta buckets where smaller


@frozen
class RolloutConfig(Section):
    # The registered rollout engines (verl.engine.rollout.registry), read when a config is checked, then the names
    # refused with a reason.
    name: str = checked(choices=ROLLOUT_NAME_CHOICES)
    mode: str = checked(choices=("sync", "async"))
    nnodes: int = checked(ge=0)          # 0: colocated (the hybrid engine); > 0: a standalone rollout pool
    n_gpus_per_node: int = checked(ge=1)
    temperature: float = checked(ge=0)
    top_k: int = checked(ge=-1)
    top_p: float = checked(gt=0, le=1)
    do_sample: bool
    n: int = checked(ge=1)
    prompt_length: int
    response_length: int
    dtype: str = checked(choices=TRAINING_DTYPES)
    gpu_memory_utilization: float = checked(gt=0, le=1)
    ignore_eos: bool
    enforce_eager: bool
    free_cache_engine: bool
    load_format: str = checked(choices=("dummy", "auto", "safetensors", "hf", "megatron"))
    tensor_model_parallel_size: int = checked(ge=1)
    data_parallel_size: int
    pipeline_model_parallel_size: int
    max_num_batched_tokens: int
    max_model_len: int | None = checked(ge=1)
    max_num_seqs: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    log_prob_micro_batch_size: int | None = checked(ge=1)
    log_prob_micro_batch_size_per_gpu: int = checked(ge=1)
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    disable_log_stats: bool
    calculate_log_probs: bool
    enable_rollout_routing_replay: bool
    engine_kwargs: EngineKwargsConfig
    val_kwargs: ValKwargsConfig
    multi_turn: MultiTurnConfig
    checkpoint_engine: CheckpointEngineConfig
    generation_timeout: float = checked(gt=0)  # verl-hpc's: the wait for the slowest rollout (generation_wait)
