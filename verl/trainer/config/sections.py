"""The trainer's own typed config sections, ``data``, ``algorithm``, ``trainer``, ``hybrid_engine`` and
``custom_reward_function`` (verl's ``AlgoConfig`` and friends), built like the roles' sections
(:mod:`verl.workers.config.section`): one typed field per YAML key, its rule in the field's metadata, no
defaults (they live in the YAML); and :class:`PPOSections`, every section of a PPO config. The config check
reads their rules; the PPO trainer builds :class:`PPOSections` once, reads its keys through it and hands each
worker its own section.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from verl.algorithms.core_algos import ADV_ESTIMATOR_NAMES, KL_PENALTY_CHOICES
from verl.utils.config_checks import ConfigError, Rule, check_value
from verl.utils.dataset.rl_dataset import TRUNCATION_MODES
from verl.workers.config import ActorRolloutRefConfig, CriticConfig, RewardModelConfig
from verl.workers.config.reward import RewardConfig
from verl.workers.config.section import Section, checked

frozen = dataclasses.dataclass(frozen=True)

TRAINER_MODES = ("sync", "colocate_async", "separate_async")
# The smallest bucket the planner is allowed: a 4 KiB page (a bucket holds one element per micro-DP
# rank at least; smaller buckets only multiply collective calls).
MIN_BUCKET_BYTES = 4096


@frozen
class DataConfig(Section):
    """``data``: the prompt files, their lengths and the batches the loop draws (also what RLHFDataset reads)."""

    tokenizer: str | None
    train_files: str | list[str] | None
    val_files: str | list[str] | None
    train_max_samples: int = checked(ge=-1)
    val_max_samples: int = checked(ge=-1)
    prompt_key: str
    reward_fn_key: str
    max_prompt_length: int = checked(ge=1)
    max_response_length: int = checked(ge=1)
    train_batch_size: int = checked(ge=1)
    gen_batch_size: int = checked(ge=1)
    val_batch_size: int | None = checked(ge=1)
    return_raw_input_ids: bool
    return_raw_chat: bool
    return_full_prompt: bool
    shuffle: bool
    validation_shuffle: bool
    seed: int | None
    dataloader_num_workers: int = checked(ge=0)
    filter_overlong_prompts: bool
    filter_overlong_prompts_workers: int = checked(ge=1)
    truncation: str = checked(choices=TRUNCATION_MODES)
    trust_remote_code: bool


@frozen
class RolloutCorrectionConfig(Section):
    """``algorithm.rollout_correction``: verl's off-policy corrections between the rollout's and the old
    policy's log-probs (:mod:`verl.algorithms.rollout_correction`): importance weights (``rollout_is``: token |
    sequence, truncated at ``rollout_is_threshold``, or zeroed outside a "lower_upper" range) and rejection
    (``rollout_rs``: comma-separated token_k*/seq_sum_k*/seq_mean_k*/seq_max_k* with ``rollout_rs_threshold``);
    or ``bypass_mode`` (old log-probs = the rollout's, no correction)."""

    bypass_mode: bool
    loss_type: str = checked(choices=("ppo_clip",))
    rollout_is: str | None = checked(choices=(None, "token", "sequence"))
    rollout_is_threshold: float | str
    rollout_rs: str | None
    rollout_rs_threshold: float | str | None
    rollout_is_batch_normalize: bool


@frozen
class KLControlConfig(Section):
    """``algorithm.kl_ctrl``: the KL-in-reward coefficient, fixed or adaptive."""

    type: str = checked(choices=("fixed", "adaptive"))
    kl_coef: float = checked(ge=0)
    horizon: int = checked(ge=1)
    target_kl: float = checked(gt=0)


@frozen
class AlgoConfig(Section):
    """``algorithm``: advantages, KL in the reward."""

    rollout_correction: RolloutCorrectionConfig
    gamma: float = checked(ge=0, le=1)
    lam: float = checked(ge=0, le=1)
    adv_estimator: str = checked(choices=ADV_ESTIMATOR_NAMES)  # the registry's names when checked
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str = checked(choices=KL_PENALTY_CHOICES)
    kl_ctrl: KLControlConfig
    use_pf_ppo: bool


@frozen
class HybridEngineConfig(Section):
    """``hybrid_engine``: the 3D-HybridEngine's reshard bucket (null: the rollout's checkpoint_engine MiB)."""

    bucket_bytes: int | None = checked(ge=MIN_BUCKET_BYTES)


@frozen
class TransferQueueMetricsConfig(Section):
    enabled: bool
    port: int = checked(ge=0)


@frozen
class SimpleStorageConfig(Section):
    total_storage_size: int = checked(ge=1)
    num_data_storage_units: int = checked(ge=1)


@frozen
class TransferQueueBackendConfig(Section):
    storage_backend: str = checked(choices=("SimpleStorage",))
    SimpleStorage: SimpleStorageConfig


@frozen
class TransferQueueConfig(Section):
    """``transfer_queue``: ``enable`` puts the step on the distributed data plane (rows stay where they are
    produced); verl's storage settings have no counterpart (rows stay in the producing rank's memory)."""

    enable: bool
    metrics: TransferQueueMetricsConfig
    backend: TransferQueueBackendConfig


@frozen
class CustomRewardFunctionConfig(Section):
    """``custom_reward_function``: a user's ``compute_score`` (function ``name`` in the file at ``path``)."""

    path: str | None
    name: str


@frozen
class ColocateAsyncConfig(Section):
    num_warmup_batches: int = checked(ge=0)


@frozen
class HybridRolloutConfig(Section):
    """``trainer.v1.separate_async.hybrid_rollout``: verl's lending of idle trainer GPUs to the rollout (refused
    when enabled; the other keys tune it)."""

    enable_switch: bool
    switch_threshold_ratio: float
    adaptive_switch_threshold: bool
    switch_threshold_step_up: float
    switch_threshold_step_down: float
    switch_threshold_release_steps: int
    switch_cost_window_size: int


@frozen
class SeparateAsyncConfig(Section):
    num_warmup_batches: int = checked(ge=0)
    parameter_sync_step: int = checked(ge=1)
    hybrid_rollout: HybridRolloutConfig


@frozen
class CustomSamplerConfig(Section):
    path: str | None
    name: str | None


@frozen
class SamplerConfig(Section):
    """``trainer.v1.sampler``: the replay buffer's staleness policy (:mod:`verl.trainer.v1.replay_buffer`)."""

    max_off_policy_threshold: int = checked(ge=1)
    max_off_policy_strategy: str = checked(choices=("drop", "wait"))
    sync_refill_failed_groups: bool
    custom_sampler: CustomSamplerConfig
    sampler_kwargs: Mapping[str, Any]


@frozen
class TrainerV1Config(Section):
    """``trainer.v1``: verl's V1 trainer modes: sync (the PPO loop), colocate_async and separate_async
    (:mod:`verl.trainer.v1`)."""

    trainer_mode: str = checked(choices=TRAINER_MODES)
    sync: Mapping[str, Any]
    colocate_async: ColocateAsyncConfig
    separate_async: SeparateAsyncConfig
    sampler: SamplerConfig


@frozen
class TrainerConfig(Section):
    """``trainer``: the loop's length, world, checkpoints, validation, logging and exports."""

    balance_batch: bool
    total_epochs: int = checked(ge=1)
    total_training_steps: int | None = checked(ge=1)
    project_name: str
    experiment_name: str
    logger: list[str] | str  # verl accepts `logger=console` and a list
    log_val_generations: int = checked(ge=0)
    rollout_data_dir: str | None
    validation_data_dir: str | None
    nnodes: int = checked(ge=1)
    n_gpus_per_node: int = checked(ge=1)
    save_freq: int = checked(ge=-1)
    resume_mode: str
    resume_from_path: str | None
    del_local_ckpt_after_load: bool
    val_before_train: bool
    test_freq: int = checked(ge=-1)
    critic_warmup: int = checked(ge=0)
    default_hdfs_dir: str | None
    default_local_dir: str
    max_actor_ckpt_to_keep: int | None = checked(ge=1)
    max_critic_ckpt_to_keep: int | None = checked(ge=1)
    device: str = checked(choices=("auto", "cuda", "cpu", "npu"))
    use_v1: bool
    v1: TrainerV1Config
    output_dir: str
    debug: str | None = checked(choices=("light", "full"))
    export_hf_every_save: bool
    export_hf_at_end: bool
    seed: int


@frozen
class PPOSections(Section):
    """Every section of a loaded PPO config, typed (the root: key ""). ``PPOTrainer.config`` stays verl's
    ``DictConfig``; ``model_engine`` is the loader's backend selector, settled into the roles' strategies."""

    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    critic: CriticConfig
    reward_model: RewardModelConfig
    reward: RewardConfig  # verl 0.9's names of reward_model keys
    custom_reward_function: CustomRewardFunctionConfig
    algorithm: AlgoConfig
    hybrid_engine: HybridEngineConfig
    transfer_queue: TransferQueueConfig
    trainer: TrainerConfig


# verl's key for a user's module (a recipe registering estimators and losses, an HF model class): imported by
# every process that loads the config, before the registered names are checked.
EXTERNAL_LIB_KEY = "actor_rollout_ref.model.external_lib"


def rules_before_user_modules(rules: Mapping[str, Rule]) -> dict[str, Rule]:
    """``rules`` without the registries' choices (live views, :class:`~verl.utils.registry_names.RegistryNames`: the
    algorithms' and the engine tables' names): :func:`import_user_modules` checks those once the user's modules have
    registered their names."""
    return {key: dataclasses.replace(r, choices=None) if _registry_choices(r) else r for key, r in rules.items()}


def _registry_choices(r: Rule) -> bool:
    """A rule whose choices are a registry's names, read when asked (a fixed list is a tuple)."""
    return r.choices is not None and not isinstance(r.choices, tuple)


def import_user_modules(cfg: Mapping[str, Any], rules: Mapping[str, Rule]) -> None:
    """Import the module ``actor_rollout_ref.model.external_lib`` names (verl's key; a dotted module on
    ``sys.path``), then check every registry-backed key of ``cfg`` against the registry as it is now."""
    lib = _leaf(cfg, EXTERNAL_LIB_KEY)
    if lib:
        try:
            importlib.import_module(lib)
        except ImportError as err:
            raise ConfigError(f"{EXTERNAL_LIB_KEY}: expected an importable module, found {lib!r} "
                              f"({type(err).__name__}: {err})") from None
    for key, r in rules.items():
        if _registry_choices(r):
            check_value(key, _leaf(cfg, key), None, r)


def _leaf(cfg: Mapping[str, Any], key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node
