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
class SamplingKeys(Section):
    """The sampling keys every section that generates carries (verl's names and ranges)."""

    do_sample: bool
    temperature: float = checked(ge=0)
    top_k: int = checked(ge=-1)
    top_p: float = checked(gt=0, le=1)


@frozen
class LogProbBatchKeys(Section):
    """How a section that computes log-probs batches them (verl's ``log_prob_*`` keys)."""

    log_prob_micro_batch_size: int | None = checked(ge=1)
    log_prob_micro_batch_size_per_gpu: int = checked(ge=1)
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int


@frozen
class ValKwargsConfig(SamplingKeys):
    """``rollout.val_kwargs``: sampling for validation."""

    n: int = checked(ge=1)


@frozen
class EngineKwargsConfig(Section):
    """``rollout.engine_kwargs``: settings passed to the engine as they are."""

    sglang: Mapping[str, Any]
    vllm: Mapping[str, Any]


@frozen
class MultiTurnConfig(Section):
    """``rollout.multi_turn``: verl's agentic rollouts (``verl.experimental.agent_loop``): tools, turn limits, the
    tool-call format. ``tool_config_path`` (verl's tool YAML), ``function_tool_path`` (a module of
    ``@function_tool`` functions) and ``format`` (a registered ``ToolParser``) are loaded by the config check."""

    enable: bool
    tool_config_path: str | None
    function_tool_path: str | None
    max_assistant_turns: int | None = checked(ge=1)
    max_user_turns: int | None = checked(ge=1)
    max_parallel_calls: int = checked(ge=1)
    max_tool_response_length: int = checked(ge=1)
    tool_response_truncate_side: str = checked(choices=("left", "middle", "right"))
    tool_timeout_s: float | None = checked(gt=0)  # verl-hpc's: a call past it is a tool error (null: no limit)
    format: str


@frozen
class AgentConfig(Section):
    """``rollout.agent``: which agent loop a dataset row without ``agent_name`` runs, and the YAML of custom
    loops (``[{name, _target_, ...}]``). ``num_workers`` is verl's count of agent-loop worker processes; here each
    rollout replica runs its trajectories as asyncio tasks in its own process, so it only has to be >= 1."""

    num_workers: int = checked(ge=1)
    default_agent_loop: str
    agent_loop_config_path: str | None


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
class RolloutConfig(SamplingKeys, LogProbBatchKeys):
    # The registered rollout engines (verl.engine.rollout.registry), read when a config is checked, then the names
    # refused with a reason.
    name: str = checked(choices=ROLLOUT_NAME_CHOICES)
    mode: str = checked(choices=("sync", "async"))
    nnodes: int = checked(ge=0)          # 0: colocated (the hybrid engine); > 0: a standalone rollout pool
    n_gpus_per_node: int = checked(ge=1)
    n: int = checked(ge=1)
    prompt_length: int
    response_length: int
    dtype: str = checked(choices=TRAINING_DTYPES)
    gpu_memory_utilization: float = checked(gt=0, le=1)
    ignore_eos: bool
    stop_token_ids: list[int] | None  # training and validation sampling both stop on them (a task's, not eos)
    enforce_eager: bool
    free_cache_engine: bool
    generation_timeout: float = checked(gt=0)  # verl-hpc's: the wait for the slowest rollout (generation_wait)
    load_format: str = checked(choices=("dummy", "auto", "safetensors", "hf", "megatron"))
    tensor_model_parallel_size: int = checked(ge=1)
    data_parallel_size: int
    pipeline_model_parallel_size: int
    max_num_batched_tokens: int
    max_model_len: int | None = checked(ge=1)
    max_num_seqs: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    disable_log_stats: bool
    calculate_log_probs: bool
    enable_rollout_routing_replay: bool
    engine_kwargs: EngineKwargsConfig
    val_kwargs: ValKwargsConfig
    multi_turn: MultiTurnConfig
    agent: AgentConfig
    checkpoint_engine: CheckpointEngineConfig
