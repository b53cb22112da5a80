"""The engine sections a role hands its training engine: ``optim``, ``megatron``, ``fsdp_config`` and the
model section (verl's ``McoreEngineConfig``, ``FSDPEngineConfig``, ``OptimizerConfig``, ``HFModelConfig``).

The reference, critic and reward model write fewer keys under ``megatron`` and ``fsdp_config`` than the actor
(the rest is the actor's: they share its processes), so each has its own class; the actor's adds its keys
and the ranges the config check holds them to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.utils.config_checks import rule
from verl.utils.torch_dtypes import FSDP_DTYPE_NAMES, TRAINING_DTYPES
from verl.workers.config.section import Section, checked

frozen = dataclasses.dataclass(frozen=True)


@frozen
class LoRAConfig(Section):
    """``actor_rollout_ref.model.lora`` and ``critic.model.lora``: Megatron's LoRA block (verl's keys;
    :mod:`verl.engine.lora`)."""

    rank: int = checked(ge=0)
    alpha: float = checked(gt=0)
    dropout: float = checked(ge=0, le=1)
    target_modules: list[str]
    exclude_modules: list[str]
    merge: bool
    adapter_path: str | None


@frozen
class LoRAModelKeys(Section):
    """The LoRA keys of verl's model sections (``actor_rollout_ref.model``, ``critic.model``): the flat
    ``lora_*`` keys for FSDP, the ``lora`` block for Megatron (:mod:`verl.engine.lora`)."""

    lora_rank: int = checked(ge=0)
    lora_alpha: float = checked(gt=0)
    target_modules: str | list[str]
    exclude_modules: list[str] | None
    lora_adapter_path: str | None
    lora: LoRAConfig


@frozen
class HFModelConfig(LoRAModelKeys):
    """``actor_rollout_ref.model``, with the LoRA keys of :class:`LoRAModelKeys`."""

    path: str | None
    tokenizer_path: str | None
    trust_remote_code: bool
    external_lib: str | None
    override_config: Mapping[str, Any]
    enable_gradient_checkpointing: bool | None  # None: chosen by memory (recompute_choice), off until chosen
    enable_activation_offload: bool
    use_remove_padding: bool
    use_fused_kernels: bool


@frozen
class OptimizerConfig(Section):
    """``*.optim``: Adam and its LR schedule (warm-up steps, or a ratio of the total when -1)."""

    optimizer: str = checked(choices=("adam",))
    lr: float = checked(ge=0)
    lr_warmup_steps: int = checked(ge=-1)
    lr_warmup_steps_ratio: float = checked(ge=0, le=1)
    lr_warmup_init: float = checked(ge=0)
    lr_decay_steps: int | None = checked(ge=1)
    lr_decay_style: str = checked(choices=("constant", "linear", "cosine"))
    min_lr: float = checked(ge=0)
    weight_decay: float = checked(ge=0)
    betas: list[float]
    clip_grad: float = checked(ge=0)
    total_training_steps: int = checked(ge=-1)


@frozen
class CheckpointConfig(Section):
    """``*.checkpoint``. LoRA: ``save_lora_only`` (verl's key: adapters and their optimizer state only) and
    ``export_merged`` (the merged model beside the PEFT adapter directory at HF export)."""

    save_contents: list[str]
    save_lora_only: bool
    export_merged: bool


# ------------------------------------------------------------------------------------------- megatron
TRANSFORMER_OVERRIDE_RULES = {  # the actor's override_transformer_config keys this stack reads itself
    "recompute_granularity": rule(str, choices=("full", "selective")),
    "recompute_method": rule(str, choices=("uniform", "block")),
    "recompute_num_layers": rule(int, ge=1),
    "moe_aux_loss_coeff": rule(float, ge=0),
    "moe_router_load_balancing_type": rule(str, choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "none")),
}


@frozen
class RewardModelMcoreConfig(Section):
    """``reward_model.megatron``: the layout (the actor's) and dtype of a forward-only model."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    seed: int
    dtype: str


@frozen
class RefMcoreConfig(RewardModelMcoreConfig):
    """``actor_rollout_ref.ref.megatron``."""

    param_offload: bool
    virtual_pipeline_model_parallel_size: int | None = checked(ge=1)
    context_parallel_size: int
    expert_model_parallel_size: int
    sequence_parallel: bool


@frozen
class CriticMcoreConfig(RefMcoreConfig):
    """``critic.megatron``: a trained model's keys too (optimizer, offload, Megatron's TransformerConfig
    overrides, passed to Megatron whatever their names)."""

    grad_offload: bool
    optimizer_offload: bool
    use_distributed_optimizer: bool
    override_transformer_config: Mapping[str, Any]


@frozen
class McoreEngineConfig(CriticMcoreConfig):
    """``actor_rollout_ref.actor.megatron``: the process's Megatron layout, which every colocated role follows."""

    tensor_model_parallel_size: int = checked(ge=1)
    pipeline_model_parallel_size: int = checked(ge=1)
    dtype: str = checked(choices=TRAINING_DTYPES)
    expert_tensor_parallel_size: int | None = checked(ge=1)
    use_dist_checkpointing: bool
    dist_checkpointing_path: str | None
    override_transformer_config: Mapping[str, Any] = dataclasses.field(metadata={"keys": TRANSFORMER_OVERRIDE_RULES})
    use_mbridge: bool
    use_remove_padding: bool


# ------------------------------------------------------------------------------------------- FSDP
@frozen
class MixedPrecisionConfig(Section):
    """``*.fsdp_config.mixed_precision`` (null: bf16 / fp32 on GPUs, the master dtype on the CPU)."""

    param_dtype: str | None = checked(choices=FSDP_DTYPE_NAMES)
    reduce_dtype: str | None = checked(choices=FSDP_DTYPE_NAMES)


@frozen
class RewardModelFSDPConfig(Section):
    """``reward_model.fsdp_config``."""

    fsdp_size: int = checked(ge=-1)
    model_dtype: str = checked(choices=FSDP_DTYPE_NAMES)
    mixed_precision: MixedPrecisionConfig
    param_offload: bool
    reshard_after_forward: bool


@frozen
class RefFSDPConfig(RewardModelFSDPConfig):
    """``actor_rollout_ref.ref.fsdp_config``."""

    offload_policy: bool


@frozen
class CriticFSDPConfig(RefFSDPConfig):
    """``critic.fsdp_config``."""

    optimizer_offload: bool


@frozen
class WrapPolicyConfig(Section):
    min_num_params: int


@frozen
class FSDPEngineConfig(CriticFSDPConfig):
    """``actor_rollout_ref.actor.fsdp_config``: the process's FSDP mesh (``fsdp_size``), which every colocated
    role follows."""

    wrap_policy: WrapPolicyConfig
