"""The PPO trainer config: verl's ``ppo_megatron_trainer.yaml`` keys, checked once before any rank starts.

``load_config(path, overrides)`` composes the packaged defaults (``verl/trainer/config/ppo_megatron_trainer.yaml``,
or ``config_dir``/``config_name`` as Hydra's ``--config-path``/``--config-name``), a user file over them
(``verl train --config F``) and Hydra-grammar overrides (:mod:`verl.trainer.config.loader`).

verl 0.9's command line is read as verl reads it: ``model_engine=megatron|dp`` selects the backend (every
role's strategy follows it) and, without ``--config-name``, the config (:func:`default_config_name`);
``ray_kwargs.*`` is dropped with one warning (no Ray here); verl 0.9's ``critic.fsdp`` section is
``critic.fsdp_config``; ``trainer.use_v1=false`` (verl's legacy trainer) is the sync loop. Then it checks:

- every leaf's type, choices and range (:data:`RULES`: the rules on the fields of the typed sections,
  :mod:`verl.trainer.config.sections` and the roles' :mod:`verl.workers.config`);
- the keys that have no meaning on this stack (:data:`REFUSED`): accepted by the parser, refused here with
  one line saying why and what to use instead;
- parallel sizes against the model (tp | heads, kv heads, ffn; pp | layers) and the world size
  (``trainer.nnodes * trainer.n_gpus_per_node``), the reference's and critic's layouts against the actor's;
- batch sizes as the PPO loop splits them (train batch -> mini-batches -> DP ranks -> micro-batches);
- under a launcher (Slurm, torchrun, mpirun) its world size against the config's.

Every problem raises one :class:`ConfigError` whose message names the key; ``verl train`` prints it as
one line and exits 2. The result is an OmegaConf ``DictConfig`` (attribute access, like verl).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from verl.engine.config_rules import check_divides as _check_divides
from verl.engine.rollout.registry import REFUSED_ROLLOUT_NAMES, require_capability, rollout_names
from verl.engine.strategies import (
    MODEL_ENGINE_NAMES,
    MODEL_ENGINES,
    STRATEGIES,
    config_rules,
    engine_entry,
    engine_name,
)
from verl.trainer.config.derived import (
    ARR,
    actor_dp_size,
    backend_rules,
    job_size,
    model_parallel_sizes,
    reshard_bucket_bytes,
    rollout_pool_size,
    use_critic,
    use_reference,
    world_size,
)
from verl.trainer.config.loader import (
    HYDRA_IGNORED,
    PACKAGED_CONFIG_DIR,
    ConfigError,
    Rule,
    compose,
    deep_get,
    named_defaults,
    override_value,
    read_user_file,
    resolve_path,
    rule,
)
from verl.trainer.config.sections import PPOSections, import_user_modules, rules_before_user_modules
from verl.utils.logging_utils import get_logger
from verl.utils.tracking import check_backends
from verl.workers.config.reward import check_reward_section, fold_reward_section

logger = get_logger(__name__)

CONFIG_NAME = "ppo_megatron_trainer"  # what `verl train --config F` files are written against
VERL_DEFAULT_CONFIG_NAME = "ppo_trainer"  # verl 0.9's main_ppo default (model_engine: dp)
REFUSED_ENGINES = {  # verl 0.9's other engines -> why not here
    "torchtitan": "TorchTitan is not part of verl-hpc",
    "veomni": "VeOmni is not part of verl-hpc",
    "mindspeed": "MindSpeed targets Ascend NPUs, which verl-hpc does not run on",
}
ENGINE_STRATEGY_RESOLVER = "verl_engine_strategy"  # ${verl_engine_strategy:${model_engine}} in the YAML
# Sections verl scripts set for machinery this stack does not have: dropped with one warning line.
IGNORED_SECTIONS = {**HYDRA_IGNORED, "ray_kwargs": "verl-hpc runs no Ray: its ranks start under Slurm, torchrun, "
                    "mpirun or the local spawner (verl.launcher)"}
# verl 0.9 names the critic's FSDP engine section `fsdp`; here (as the actor's) it is `fsdp_config`. The documents'
# local-trainer YAML (003) names the actor's section after its role without a reference, `actor_rollout`.
SECTION_ALIASES = {"critic.fsdp": "critic.fsdp_config", "actor_rollout": "actor_rollout_ref"}
FSDP_ROLES = (f"{ARR}.actor", f"{ARR}.ref", "critic", "reward_model")
# Each key's rule beyond its default's type (choices, ranges, other types): the one on its typed section's field
# (verl.trainer.config.sections, verl.workers.config).
RULES: dict[str, Rule] = {
    "model_engine": rule(choices=MODEL_ENGINE_NAMES),
    **PPOSections.rules(""),
}


def _cuda() -> bool:
    from verl.utils.device import is_cuda_available

    return is_cuda_available()


# Keys that parse but have no meaning on this stack: (key, predicate on the value that is refused, why and
# what to use instead). Checked after the types, before anything else.
REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    *((f"{ARR}.rollout.name", lambda v, name=name: v == name and name not in rollout_names(), why)
      for name, why in REFUSED_ROLLOUT_NAMES.items()),
    (f"{ARR}.rollout.data_parallel_size", lambda v: v != 1, "the rollout's DP size is world / rollout tp here: set 1"),
    (f"{ARR}.rollout.pipeline_model_parallel_size", lambda v: v != 1,
     "the rollout has no pipeline stages here: set 1"),
    (f"{ARR}.hybrid_engine", lambda v: not v, "verl-hpc always colocates actor and rollout (the 3D-HybridEngine)"),
    (f"{ARR}.model.enable_activation_offload", bool, "activation offload is not implemented: set false"),
    *((f"{role}.megatron.virtual_pipeline_model_parallel_size", lambda v: v is not None,
       "the interleaved (virtual) pipeline schedule is not implemented: set null")
      for role in (f"{ARR}.actor", f"{ARR}.ref", "critic")),
    *((f"{role}.megatron.context_parallel_size", lambda v: v != 1, "context parallelism is not implemented: set 1")
      for role in (f"{ARR}.actor", f"{ARR}.ref", "critic")),
    # The actor's and the reference's offload while the rollout generates (verl.engine.offload); the critic
    # has no idle phase of its own in this loop yet.
    *((f"critic.megatron.{key}", lambda v: v and _cuda(),
       "offloading the critic's Megatron state between phases is not implemented on GPUs yet (the actor's is; "
       "on CPU the state already lives in host memory): set false")
      for key in ("param_offload", "grad_offload", "optimizer_offload")),
    (f"{ARR}.actor.megatron.use_dist_checkpointing", bool,
     "initial weights come from model.path (an HF directory); turn a Megatron checkpoint into one with "
     "`verl convert mcore-to-hf --ckpt DIR --out HF_DIR`, then set use_dist_checkpointing=false"),
    ("algorithm.use_pf_ppo", bool, "PF-PPO reweighting is not implemented: set false"),
    ("trainer.default_hdfs_dir", lambda v: v is not None, "there is no HDFS here: set null (checkpoints go to "
     "trainer.default_local_dir)"),
    ("trainer.del_local_ckpt_after_load", bool, "set false: verl-hpc keeps local checkpoints"),
    ("trainer.device", lambda v: v == "npu", "verl-hpc runs on cuda or cpu"),
    ("trainer.device", lambda v: v == "cuda" and not _cuda(), "no CUDA device is visible here: use auto or cpu"),
    ("transfer_queue.metrics.enabled", bool, "verl-hpc opens no HTTP endpoint: the data plane's figures are "
     "logged as metrics (perf/data_plane_*); set false"),
)


_VLLM_KNOB = ("a vLLM engine setting; the native engine generates each rank's whole batch at once, and SGLang "
              "takes its own engine settings from rollout.engine_kwargs.sglang")
# The vLLM settings the vLLM rollout reads itself (verl.engine.rollout.registry.vllm_engine_args): no warning with it.
_VLLM_READS = {f"{ARR}.rollout.{key}" for key in ("enforce_eager", "max_num_batched_tokens", "max_num_seqs",
                                                   "max_model_len", "enable_chunked_prefill", "disable_log_stats")}
# Keys verl scripts set that change nothing here: a value other than the packaged default gets a warning
# naming why (never silently ignored); the default itself is quiet.
NO_EFFECT: dict[str, str] = {
    **{f"{ARR}.rollout.{key}": _VLLM_KNOB for key in (
        "enforce_eager", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "enable_chunked_prefill",
        "disable_log_stats")},
    f"{ARR}.rollout.calculate_log_probs": "the rollout always returns its log-probs (rollout_log_probs)",
    f"{ARR}.actor.use_torch_compile": "nothing is torch.compile'd here",
    f"{ARR}.actor.data_loader_seed": "mini-batch shuffles are seeded by the step (actor.shuffle)",
    "data.return_raw_chat": "prompts are rendered with the tokenizer's chat template in the dataset",
    "data.return_raw_input_ids": "prompts are rendered with the tokenizer's chat template in the dataset",
    "data.return_full_prompt": "the generations dump (trainer.rollout_data_dir) holds the full prompt",
    "data.validation_shuffle": "validation runs over the whole set in order",
    "data.filter_overlong_prompts_workers": "the over-long filter runs in one pass before step 1",
    f"{ARR}.model.trust_remote_code": "models are built from their config, no remote code is run",
    "data.trust_remote_code": "tokenizers load locally, no remote code is run",
    "trainer.v1.sampler.sync_refill_failed_groups": "no rollout fails here without failing the job, so no group "
    "needs a refill",
    **{f"trainer.v1.separate_async.hybrid_rollout.{key}": "it tunes hybrid_rollout.enable_switch, which is refused"
       for key in ("switch_threshold_ratio", "adaptive_switch_threshold", "switch_threshold_step_up",
                   "switch_threshold_step_down", "switch_threshold_release_steps", "switch_cost_window_size")},
    **{f"transfer_queue.{key}": "rows stay in the memory of the rank that produced them (no storage units)"
       for key in ("backend.SimpleStorage.total_storage_size", "backend.SimpleStorage.num_data_storage_units",
                   "metrics.port")},
}


def _warn_no_effect(cfg: dict[str, Any], defaults: dict[str, Any]) -> None:
    for key, why in NO_EFFECT.items():
        try:
            value, default = deep_get(cfg, key), deep_get(defaults, key)
        except KeyError:  # a --config-path config without the key
            continue
        if value != default and not (why is _VLLM_KNOB and key in _VLLM_READS and _rollout_name(cfg) == "vllm"):
            logger.warning("config: %s=%r has no effect in verl-hpc: %s", key, value, why)


def _rollout_name(cfg: dict[str, Any]) -> str | None:
    try:
        return deep_get(cfg, f"{ARR}.rollout.name")
    except KeyError:
        return None


def _leaves(tree: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}"))
    return out


def _warn_other_backend(cfg: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Keys of the backend the actor does not use, set away from their defaults, do nothing: say so."""
    own = backend_rules(cfg).sections
    unused = tuple(dict.fromkeys(key for name in STRATEGIES for key in config_rules(name).sections if key not in own))
    strategy = cfg[ARR]["actor"]["strategy"]
    for role in FSDP_ROLES:
        section, base = deep_get(cfg, role), deep_get(defaults, role)
        for key in unused:
            if key not in section or key not in base:
                continue
            have, default = _leaves(section[key], f"{role}.{key}"), _leaves(base[key], f"{role}.{key}")
            actor = _leaves(cfg[ARR]["actor"].get(key, {}), f"{ARR}.actor.{key}")
            # Other roles' copies interpolated from the actor's are the actor's setting: said once.
            changed = sorted(k for k, v in have.items() if k in default and v != default[k]
                             and (role == f"{ARR}.actor" or actor.get(k.replace(role, f"{ARR}.actor", 1)) != v))
            for name in changed:
                logger.warning("config: %s=%r has no effect with %s.actor.strategy=%s", name, have[name], ARR,
                               strategy)


def _refuse_meaningless(cfg: dict[str, Any]) -> None:
    for key, refused, why in REFUSED:
        value = deep_get(cfg, key)
        if refused(value):
            raise ConfigError(f"{key}={value!r}: not supported by verl-hpc: {why}")
    _check_rollout_correction(cfg["algorithm"]["rollout_correction"])


def _check_rollout_correction(rc: dict[str, Any]) -> None:
    """``algorithm.rollout_correction``: the thresholds parse (verl's float / "lower_upper" forms)."""
    from verl.errors import InputError

    if rc["rollout_is"] is None and rc["rollout_rs"] is None:
        return
    from verl.algorithms.rollout_correction import parse_is_threshold, parse_rs

    try:
        if rc["rollout_is"] is not None:
            parse_is_threshold(rc["rollout_is_threshold"])
        if rc["rollout_rs"] is not None:
            parse_rs(rc["rollout_rs"], rc["rollout_rs_threshold"])
    except InputError as err:
        raise ConfigError(str(err)) from None
    if rc["bypass_mode"]:
        raise ConfigError("algorithm.rollout_correction.bypass_mode=true: expected rollout_is and rollout_rs null "
                          "(bypass uses the rollout's log-probs as the old policy's, so there is nothing to correct "
                          f"between them), found rollout_is={rc['rollout_is']!r}, rollout_rs={rc['rollout_rs']!r}")


def trainer_mode(cfg: Any) -> str:
    """The V1 trainer mode that runs: verl's legacy trainer (``use_v1=false``) is the sync loop."""
    trainer = cfg["trainer"]
    return trainer["v1"]["trainer_mode"] if trainer["use_v1"] else "sync"


def _check_v1(cfg: dict[str, Any]) -> None:
    """verl's V1 asynchronous modes: what each needs, refused in one line before any rank starts."""
    mode = trainer_mode(cfg)
    v1, arr = cfg["trainer"]["v1"], cfg[ARR]
    sampler = v1["sampler"]
    if sampler["custom_sampler"]["path"] is not None:
        raise ConfigError("trainer.v1.sampler.custom_sampler.path: not supported by verl-hpc: the replay buffer is "
                          "verl.trainer.v1.replay_buffer.ReplayBuffer (staleness via max_off_policy_*): set null")
    if sampler["sampler_kwargs"]:
        raise ConfigError("trainer.v1.sampler.sampler_kwargs: expected {} (they configure a custom sampler, which "
                          f"verl-hpc does not load), found {dict(sampler['sampler_kwargs'])!r}")
    if v1["separate_async"]["hybrid_rollout"]["enable_switch"]:
        raise ConfigError("trainer.v1.separate_async.hybrid_rollout.enable_switch=true: not supported by verl-hpc: "
                          "lending idle training ranks to the rollout is not implemented: set false")
    if mode == "sync":
        return
    warmup, threshold = v1[mode]["num_warmup_batches"], sampler["max_off_policy_threshold"]
    if sampler["max_off_policy_strategy"] == "wait" and warmup >= threshold:
        # The buffer stays num_warmup_batches + 1 batches deep and wait evicts nothing, so every group trains at
        # age num_warmup_batches + 1: the threshold would bound nothing.
        raise ConfigError(f"trainer.v1.{mode}.num_warmup_batches={warmup}: expected < trainer.v1.sampler."
                          f"max_off_policy_threshold ({threshold}) with max_off_policy_strategy=wait (every group "
                          f"would train {warmup + 1} versions after its submission, past the threshold): lower "
                          "num_warmup_batches, raise the threshold, or use max_off_policy_strategy=drop")
    rollout, pool = arr["rollout"], rollout_pool_size(cfg)
    require_capability(rollout["name"], "partial_rollout", f"trainer.v1.trainer_mode={mode}")
    if cfg["algorithm"]["adv_estimator"] == "remax":
        raise ConfigError(f"algorithm.adv_estimator=remax with trainer.v1.trainer_mode={mode}: not supported: "
                          "ReMax's greedy baseline is generated with the current weights each step: use grpo, rloo, "
                          "reinforce_plus_plus or gae, or trainer_mode=sync")
    if mode == "colocate_async" and pool:
        raise ConfigError(f"trainer.v1.trainer_mode=colocate_async: expected the rollout colocated with training "
                          f"({ARR}.rollout.nnodes=0), found a standalone rollout pool (nnodes={rollout['nnodes']}): "
                          "use separate_async")
    if mode == "separate_async":
        if not pool:
            raise ConfigError(f"trainer.v1.trainer_mode=separate_async: expected a standalone rollout pool "
                              f"({ARR}.rollout.nnodes > 0 and rollout.n_gpus_per_node > 0), found nnodes="
                              f"{rollout['nnodes']}")
        steps, mini = v1["separate_async"]["parameter_sync_step"], arr["actor"]["ppo_mini_batch_size"]
        if cfg["data"]["train_batch_size"] != steps * mini:
            raise ConfigError(f"data.train_batch_size={cfg['data']['train_batch_size']}: expected "
                              f"trainer.v1.separate_async.parameter_sync_step ({steps}) x {ARR}.actor."
                              f"ppo_mini_batch_size ({mini}) = {steps * mini} (verl: one weight sync per train batch "
                              "of mini-batch updates)")


def _check_multi_turn(cfg: dict[str, Any], data_pending: bool) -> None:
    """``rollout.multi_turn.enable``: the engine serves agent loops, the tools load (verl's tool YAML, the
    ``@function_tool`` module), the tool-call format and every agent name (the default, the custom loops' YAML,
    the data files' ``agent_name`` column) are known; one line before any rank starts."""
    rollout = cfg[ARR]["rollout"]
    mt, agent = rollout["multi_turn"], rollout["agent"]
    if not mt["enable"]:
        return
    from verl.errors import InputError
    from verl.experimental.agent_loop.agent_loop import check_agent_names, load_agent_loop_config
    from verl.experimental.agent_loop.tool_parser import ToolParser
    from verl.tools.tool_registry import load_all_tools

    key = f"{ARR}.rollout.multi_turn"
    require_capability(rollout["name"], "agent_loop", f"{key}.enable=true")
    mode = trainer_mode(cfg)
    if mode in ("colocate_async", "separate_async"):
        require_capability(rollout["name"], "agent_loop_async", f"{key}.enable=true with trainer.v1.trainer_mode="
                                                                f"{mode}")
    if mt["format"] not in ToolParser._registry:
        raise ConfigError(f"{key}.format={mt['format']!r}: expected a tool-call format among "
                          f"{sorted(ToolParser._registry)} (or one registered by actor_rollout_ref.model.external_lib)")
    try:
        load_all_tools(mt["tool_config_path"], mt["function_tool_path"])
        if agent["agent_loop_config_path"]:
            load_agent_loop_config(agent["agent_loop_config_path"])
        names = {agent["default_agent_loop"]}
        for data_key in ("train_files", "val_files") if not data_pending else ():
            files = cfg["data"][data_key]
            for path in ([files] if isinstance(files, str) else files or []):
                names |= _agent_names_in(path)
        check_agent_names(sorted(names))
    except InputError as err:  # the tools' and loops' own one-line messages, as the config's
        raise ConfigError(f"{key}: {err}") from None


def _agent_names_in(path: str) -> set[str]:
    """The ``agent_name`` values of a parquet file (only that column is read); none when it has no such column."""
    import pyarrow.parquet as pq

    try:
        if "agent_name" not in pq.read_schema(path).names:
            return set()
        column = pq.read_table(path, columns=["agent_name"]).column("agent_name").to_pylist()
    except (OSError, ValueError):
        return set()  # the dataset's own check names an unreadable file
    return {str(name) for name in column if name is not None}


# --------------------------------------------------------------------------- verl 0.9's backend selector
def _engine_strategy(engine: Any) -> Any:
    """``${verl_engine_strategy:${model_engine}}``: the strategy every role defaults to (an unknown engine is
    passed through, so that the check of model_engine names it)."""
    return MODEL_ENGINES[engine][1] if engine in MODEL_ENGINES else engine


def _register_engine_resolver() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(ENGINE_STRATEGY_RESOLVER):
        OmegaConf.register_new_resolver(ENGINE_STRATEGY_RESOLVER, _engine_strategy)


def chosen_engine(path: str | None, overrides: Sequence[str]) -> str | None:
    """The ``model_engine`` the command line (last wins) or the ``--config`` file sets, checked; None when
    neither sets it."""
    given, engine = override_value(overrides, "model_engine")
    if not given and path is not None:
        user = read_user_file(path)
        given, engine = "model_engine" in user, user.get("model_engine")
    if not given:
        return None
    if engine in REFUSED_ENGINES:
        raise ConfigError(f"model_engine={engine!r}: not supported by verl-hpc ({REFUSED_ENGINES[engine]}): "
                          f"expected megatron (Megatron-core) or dp (FSDP2), found {engine!r}")
    if engine not in MODEL_ENGINES:
        raise ConfigError(f"model_engine: expected one of {list(MODEL_ENGINES)} (dp is verl's FSDP engine), "
                          f"found {engine!r}")
    return engine


def default_config_name(path: str | None, engine: str | None) -> str:
    """The config ``main_ppo`` composes when no ``--config-name`` is given: as verl 0.9, the one for
    ``model_engine`` (megatron: ppo_megatron_trainer, dp: ppo_trainer) and, without it, verl's
    ``ppo_trainer`` (FSDP); a verl-hpc ``--config`` file keeps the Megatron defaults it was written for."""
    if engine is not None:
        return MODEL_ENGINES[engine][0]
    return CONFIG_NAME if path is not None else VERL_DEFAULT_CONFIG_NAME


def _settle_engine(cfg: dict[str, Any], engine: str | None) -> None:
    """``model_engine`` names the backend the roles run: an explicit one must agree with an explicitly set
    ``actor.strategy``; otherwise it is the strategy's (a file with ``strategy: fsdp`` is model_engine dp)."""
    strategy = cfg[ARR]["actor"]["strategy"]
    backend = engine_entry(strategy).model_engine
    if engine is not None and backend != engine:
        expected = " or ".join(name for name in STRATEGIES if engine_entry(name).model_engine == engine)
        raise ConfigError(f"{ARR}.actor.strategy: expected {expected} with model_engine={engine} (it picks the "
                          f"backend), found {strategy!r}")
    cfg["model_engine"] = backend


# --------------------------------------------------------------------------- semantic checks
def _validate(cfg: dict[str, Any], launcher_world_size: int | None, data_pending: bool = False) -> None:
    from verl.models.config import ModelConfig, ModelConfigError

    data, arr, algo, trainer = cfg["data"], cfg["actor_rollout_ref"], cfg["algorithm"], cfg["trainer"]
    actor, rollout, critic = arr["actor"], arr["rollout"], cfg["critic"]
    _refuse_meaningless(cfg)
    _check_v1(cfg)
    _check_multi_turn(cfg, data_pending)
    mode = trainer["resume_mode"]
    if mode == "resume_path":
        path = trainer["resume_from_path"]
        if path is None or not os.path.isdir(path):
            raise ConfigError(f"trainer.resume_from_path: expected a checkpoint directory (global_step_<N>) for "
                              f"resume_mode=resume_path, found {'null' if path is None else 'nothing at ' + path}")
    elif mode not in ("auto", "disable") and not os.path.isdir(mode):
        raise ConfigError(f"trainer.resume_mode: expected auto, disable, resume_path or an existing checkpoint "
                          f"directory, found {mode!r}")
    try:
        check_backends(trainer["logger"])
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for key in ("train_files", "tokenizer"):
        if data[key] is None:
            raise ConfigError(f"data.{key}: expected a path, found null")
    for key in ("train_files", "val_files") if not data_pending else ():
        files = data[key]
        for path in ([files] if isinstance(files, str) else files or []):
            if not os.path.isfile(path):
                raise ConfigError(f"data.{key}: expected an existing parquet file, found no file at {path} "
                                  f"(generate the quickstart data with `verl data arithmetic --out DIR`)")
    if not data_pending and not os.path.isdir(data["tokenizer"]):
        raise ConfigError(f"data.tokenizer: expected a tokenizer directory, found nothing at {data['tokenizer']}")
    if arr["model"]["path"] is None:
        raise ConfigError("actor_rollout_ref.model.path: expected an HF config.json or model directory, found null")
    try:
        model = ModelConfig.from_pretrained(arr["model"]["path"])
    except ModelConfigError as err:
        raise ConfigError(f"actor_rollout_ref.model.path: {err}") from None
    stops = rollout["stop_token_ids"] or []
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < model.vocab_size for t in stops):
        raise ConfigError(f"actor_rollout_ref.rollout.stop_token_ids: expected token ids in [0, {model.vocab_size}) "
                          f"(the model's vocabulary), found {list(stops)}")

    # Parallel layout: Megatron (t, p, d) or FSDP (every rank a DP rank) for actor, reference, critic and
    # reward model; rollout t_g.
    world = world_size(cfg)
    tp, pp = model_parallel_sizes(cfg)
    backend_rules(cfg).check_layout(cfg, model, world)
    _check_role_layouts(cfg)
    _check_critic_lora(cfg, model)
    _check_routing_replay(cfg, model)
    if model.is_moe:
        require_capability(rollout["name"], "moe_weights", f"the MoE model {model.model_type}")
    rollout_tp = rollout["tensor_model_parallel_size"]
    pool = rollout_pool_size(cfg)
    if pool:
        _check_divides("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout_tp,
                       "the rollout pool (rollout.nnodes * rollout.n_gpus_per_node)", pool)
    else:
        _check_divides("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout_tp, "world size", world)
    for key, value in (("num_attention_heads", model.num_attention_heads),
                       ("intermediate_size", model.intermediate_size),
                       *((("moe_intermediate_size", model.moe_intermediate_size),) if model.is_moe else ())):
        _check_divides("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout_tp, key, value)
    dp = world // (tp * pp)
    rollout_dp = world // rollout_tp

    # Batch sizes: train batch -> mini-batches -> DP ranks -> micro-batches (all in responses).
    n = rollout["n"]
    train_bs = data["train_batch_size"]
    # A standalone pool splits each batch over its replicas as evenly as the rows allow.
    if not pool and train_bs % rollout_dp:
        raise ConfigError(f"data.train_batch_size={train_bs}: expected a multiple of the rollout DP size "
                          f"(world {world} / rollout tp {rollout_tp} = {rollout_dp})")
    limit = data["train_max_samples"]
    if 0 < limit < train_bs:
        raise ConfigError(f"data.train_max_samples={limit}: expected -1 (every row) or at least "
                          f"data.train_batch_size={train_bs} (one batch), found {limit}")
    roles = [("actor_rollout_ref.actor", actor)] + ([("critic", critic)] if use_critic(cfg) else [])
    for name, role in roles:
        mini = role["ppo_mini_batch_size"]
        # verl refuses a mini-batch larger than the batch (train_batch_size >= ppo_mini_batch_size) and a training
        # micro-batch that does not divide the mini-batch (its gradient accumulation is mini // micro); it takes a
        # shorter last mini-batch, whose gradient it then scales as a full one's: an optimizer step weighted by
        # rows it does not have, which this check refuses.
        if mini > train_bs:
            raise ConfigError(f"{name}.ppo_mini_batch_size={mini}: expected at most data.train_batch_size="
                              f"{train_bs} (as verl: train_batch_size >= ppo_mini_batch_size)")
        if train_bs % mini:
            raise ConfigError(f"{name}.ppo_mini_batch_size={mini}: expected a divisor of data.train_batch_size="
                              f"{train_bs}, found remainder {train_bs % mini}: a shorter last mini-batch would be "
                              f"an optimizer step whose loss is scaled as a full mini-batch's")
        _check_divides(f"{name}.ppo_mini_batch_size * rollout.n / dp ({dp})", dp,
                       f"{name}.ppo_mini_batch_size * rollout.n", mini * n)
        if not role["use_dynamic_bsz"]:  # with it, micro-batches are cut by tokens (ppo_max_token_len_per_gpu)
            micro, rows = role["ppo_micro_batch_size_per_gpu"], mini * n // dp
            if rows % micro:
                raise ConfigError(f"{name}.ppo_micro_batch_size_per_gpu={micro}: expected a divisor of {name}."
                                  f"ppo_mini_batch_size * rollout.n / dp={rows}, found remainder {rows % micro} "
                                  f"(as verl: gradient accumulation over ppo_mini_batch_size // micro-batch "
                                  f"equal micro-batches)")
    for key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"):
        section, _, leaf = key.rpartition(".")
        if arr[section.split(".")[1]]["log_prob_use_dynamic_bsz"]:
            continue
        micro = arr[section.split(".")[1]][leaf]
        if trainer_mode(cfg) == "separate_async":  # each mini-batch is scored (and trained) as it arrives
            _check_forward_micro(key, micro, "actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n / dp "
                                 "(separate_async computes log-probs per mini-batch)",
                                 actor["ppo_mini_batch_size"] * n // dp, pp)
        else:
            _check_forward_micro(key, micro, "data.train_batch_size * rollout.n / dp", train_bs * n // dp, pp)
    _check_token_budgets(cfg, roles, pp)
    if algo["adv_estimator"] in ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized",
                                 "reinforce_plus_plus_baseline") and n < 2:
        raise ConfigError(f"actor_rollout_ref.rollout.n: expected >= 2 for {algo['adv_estimator']} "
                          f"(group baselines), found {n}")
    if model.max_position_embeddings < data["max_prompt_length"] + data["max_response_length"]:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length: expected <= the model's max_position_embeddings="
            f"{model.max_position_embeddings}, found {data['max_prompt_length'] + data['max_response_length']}")
    check_reward_section(cfg)  # verl 0.9's reward.* beyond the folded keys (a judge, a reward manager's file)
    if cfg["reward_model"]["enable"] and cfg["reward"]["reward_model"]["judge"]["prompt_template"] is not None:
        from verl.workers.reward_judge import check_judge

        check_judge(cfg, cfg["data"]["tokenizer"])
    elif cfg["reward_model"]["enable"]:
        _validate_reward_model(cfg, model, tp, pp, train_bs * n // dp)
        if algo["adv_estimator"] == "remax":  # the greedy baselines: one response per prompt
            _check_forward_micro("reward_model.micro_batch_size_per_gpu",
                                 cfg["reward_model"]["micro_batch_size_per_gpu"],
                                 "data.train_batch_size / dp (remax's greedy baselines)", train_bs // dp, pp)
    elif cfg["reward_model"]["hot_swap"]["watch"] or cfg["reward_model"]["hot_swap"]["path"] is not None:
        raise ConfigError("reward_model.hot_swap: expected reward_model.enable=true to swap a reward model, "
                          "found it false")
    if launcher_world_size is not None and launcher_world_size != job_size(cfg):
        pools = f" + {rollout['nnodes']} * {rollout['n_gpus_per_node']}" if pool else ""
        rollout_keys = " + actor_rollout_ref.rollout.nnodes * rollout.n_gpus_per_node" if pool else ""
        raise ConfigError(f"trainer.nnodes * trainer.n_gpus_per_node{rollout_keys}: expected "
                          f"the launcher's world size {launcher_world_size}, found {trainer['nnodes']} * "
                          f"{trainer['n_gpus_per_node']}{pools} = {job_size(cfg)}")


def _check_forward_micro(key: str, micro: int, total_what: str, total: int, pp: int) -> None:
    """A forward-only micro-batch size (log-probs, reward scores) as verl reads it: the rows split into micro-batches
    of ``micro`` rows, the last one shorter when ``micro`` does not divide them, one micro-batch when ``micro`` is at
    least the rows (verl's ``DataProto.split``). Under pipeline parallelism the micro-batches must be equal."""
    if micro >= total or total % micro == 0 or pp == 1:
        return
    raise ConfigError(f"{key}={micro}: expected a divisor of {total_what}={total} or at least it (one micro-batch) "
                      f"with pipeline_model_parallel_size={pp}, found remainder {total % micro}: pipeline stages "
                      f"exchange activations of one micro-batch shape, which a shorter last micro-batch breaks")


def _check_token_budgets(cfg: dict[str, Any], roles: list[tuple[str, Any]], pp: int) -> None:
    """verl's dynamic batch size: micro-batches of at most N valid tokens. Every sequence must fit one
    (N >= max_prompt_length + max_response_length, verl's assertion), and the micro-batches' row counts
    vary, which pipeline stages cannot exchange (pp must be 1)."""
    arr = cfg[ARR]
    budgets = [(f"{name}.use_dynamic_bsz", role["use_dynamic_bsz"], f"{name}.{key}", role[key])
               for name, role in roles for key in ("ppo_max_token_len_per_gpu",)
               + (("forward_max_token_len_per_gpu",) if name == "critic" else ())]
    budgets += [(f"{ARR}.{name}.log_prob_use_dynamic_bsz", arr[name]["log_prob_use_dynamic_bsz"],
                 f"{ARR}.{name}.log_prob_max_token_len_per_gpu", arr[name]["log_prob_max_token_len_per_gpu"])
                for name in ("rollout", "ref") if name == "rollout" or use_reference(cfg)]
    longest = cfg["data"]["max_prompt_length"] + cfg["data"]["max_response_length"]
    for use_key, used, key, budget in budgets:
        if not used:
            continue
        if pp > 1:
            raise ConfigError(f"{use_key}=true: token-budget micro-batches vary in rows, which pipeline stages "
                              f"cannot exchange: expected {ARR}.actor.megatron.pipeline_model_parallel_size=1, "
                              f"found {pp}")
        if budget is None or budget < longest:
            raise ConfigError(f"{key}={budget}: expected at least data.max_prompt_length + data.max_response_length"
                              f"={longest} (one sequence per micro-batch at least) with {use_key}=true")


def _check_routing_replay(cfg: dict[str, Any], model: Any) -> None:
    """verl's MoE routing replay: R3 (the actor replays the rollout's routing), recorded by the native engine in
    a colocated, synchronous run."""
    replay, rollout = cfg[ARR]["actor"]["router_replay"], cfg[ARR]["rollout"]
    key = f"{ARR}.rollout.enable_rollout_routing_replay"
    if replay["mode"] == "R2":
        raise ConfigError(f"{ARR}.actor.router_replay.mode: R2 (replaying the actor's own old-log-prob routing) is "
                          f"not implemented: use R3 with {key}=true, or disabled")
    for name in ("record_file", "replay_file"):
        if replay[name] is not None:
            raise ConfigError(f"{ARR}.actor.router_replay.{name}: expected null (routing travels with the batch "
                              f"here, not through files), found {replay[name]!r}")
    if replay["mode"] == "R3" and not rollout["enable_rollout_routing_replay"]:
        raise ConfigError(f"{key}: expected true with actor.router_replay.mode=R3 (the actor replays what the "
                          "rollout records), found false")
    if not rollout["enable_rollout_routing_replay"]:
        return
    if not model.is_moe:
        raise ConfigError(f"{key}: expected false for the dense model {model.model_type} (it has no router)")
    require_capability(rollout["name"], "routing_recording", f"{key}=true")
    mega = cfg[ARR]["actor"]["megatron"]
    recompute = (mega["override_transformer_config"].get("recompute_granularity") is not None
                 or cfg[ARR]["model"]["enable_gradient_checkpointing"])
    if replay["mode"] == "R3" and recompute and mega["pipeline_model_parallel_size"] > 1:
        raise ConfigError(f"{ARR}.actor.router_replay.mode=R3 with activation recompute and pipeline_model_parallel_"
                          f"size={mega['pipeline_model_parallel_size']}: not supported (the pipeline schedule "
                          "recomputes a micro-batch after the next one's forward set its routing); drop one of them")
    if rollout_pool_size(cfg) or trainer_mode(cfg) != "sync":
        raise ConfigError(f"{key}: expected a colocated synchronous run (routing is recorded by the colocated "
                          f"native engine in one pass), found rollout.nnodes={rollout['nnodes']} and trainer mode "
                          f"{trainer_mode(cfg)}")


def _check_critic_lora(cfg: dict[str, Any], actor_model: Any) -> None:
    """A running critic's LoRA keys (verl's, under ``critic.model``) against the critic's model, as the actor's."""
    from verl.models.config import ModelConfig, ModelConfigError

    section = cfg["critic"]["model"]
    if not use_critic(cfg) or not (section["lora_rank"] or section["lora"]["rank"]):
        return
    path = section["path"]  # _derive made a null path the actor's
    try:
        model = actor_model if path == cfg[ARR]["model"]["path"] else ModelConfig.from_pretrained(path)
    except ModelConfigError as err:
        raise ConfigError(f"critic.model.path: {err}") from None
    from verl.engine.lora import check_lora_section  # imports torch: only with LoRA on

    check_lora_section(section, "critic.model", model, config_rules(cfg["critic"]["strategy"]))


def _check_role_layouts(cfg: dict[str, Any]) -> None:
    """Reference, critic and reward model run in the actor's processes: one training backend for all of them
    (as verl asserts), whose rules hold their layouts to the actor's (one parallel state per process)."""
    used = {f"{ARR}.ref": use_reference(cfg), "critic": use_critic(cfg), "reward_model": cfg["reward_model"]["enable"]}
    sections = {f"{ARR}.ref": cfg[ARR]["ref"], "critic": cfg["critic"], "reward_model": cfg["reward_model"]}
    running = {name: section for name, section in sections.items() if used[name]}
    strategy = cfg[ARR]["actor"]["strategy"]
    for name, section in running.items():
        if engine_name(section["strategy"]) != engine_name(strategy):
            raise ConfigError(f"{name}.strategy: expected the actor's backend ({ARR}.actor.strategy={strategy}: "
                              f"colocated roles share one process), found {section['strategy']!r}")
    backend_rules(cfg).check_role_layouts(cfg, running)


def _validate_reward_model(cfg: dict[str, Any], actor_model: Any, tp: int, pp: int, per_dp_batch: int) -> None:
    from verl.models.config import ModelConfig, ModelConfigError
    from verl.models.mcore.model import ModelLayoutError, check_parallel_layout
    from verl.workers.reward_model.plan import check_reward_models

    rm = cfg["reward_model"]
    _check_forward_micro("reward_model.micro_batch_size_per_gpu", rm["micro_batch_size_per_gpu"],
                         "data.train_batch_size * rollout.n / dp", per_dp_batch, pp)
    swap = rm["hot_swap"]
    if (swap["path"] is None) != (swap["at_step"] is None):
        raise ConfigError(f"reward_model.hot_swap.path and reward_model.hot_swap.at_step: expected both or neither, "
                          f"found path={swap['path']!r} at_step={swap['at_step']!r}")
    for key in ("model.path", "hot_swap.path"):
        path = rm["model"]["path"] if key == "model.path" else swap["path"]
        if key == "hot_swap.path" and path is None:
            continue
        if path is None or not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"reward_model.{key}: expected an HF reward model directory (config.json + safetensors "
                              f"with score.weight), found {'null' if path is None else 'no config.json in ' + path}")
        # Its head, engine and tokens (verl.workers.reward_model.plan); fills model.input_tokenizer when needed.
        plan = check_reward_models(rm, cfg["data"]["tokenizer"])[key]
        if plan.engine == "replicated":
            continue  # transformers' module on every rank: no Megatron layout, its own vocabulary
        try:
            model = ModelConfig.from_pretrained(path)
            check_parallel_layout(model, tp, pp)
        except (ModelConfigError, ModelLayoutError) as err:
            raise ConfigError(f"reward_model.{key}: {err}") from None
        if not plan.retokenize and model.vocab_size != actor_model.vocab_size:
            raise ConfigError(f"reward_model.{key}: expected the actor's vocab_size={actor_model.vocab_size} (the "
                              f"reward model scores the actor's token ids), found {model.vocab_size}")


def _derive(cfg: dict[str, Any], base_dir: str) -> None:
    """Paths resolved; verl's null-means-another-key defaults filled in."""
    data, arr, trainer = cfg["data"], cfg[ARR], cfg["trainer"]
    for key in ("train_files", "val_files"):
        if isinstance(data[key], list):
            data[key] = [resolve_path(p, base_dir) for p in data[key]]
        else:
            data[key] = resolve_path(data[key], base_dir)
    if data["seed"] is None:
        data["seed"] = 1
    if isinstance(trainer["logger"], str):
        trainer["logger"] = [trainer["logger"]]
    arr["model"]["path"] = resolve_path(arr["model"]["path"], base_dir)
    # verl: the tokenizer is the model's own unless data.tokenizer / model.tokenizer_path says otherwise.
    data["tokenizer"] = resolve_path(data["tokenizer"] or arr["model"]["tokenizer_path"], base_dir)
    if data["tokenizer"] is None and arr["model"]["path"] and os.path.isdir(arr["model"]["path"]):
        data["tokenizer"] = arr["model"]["path"]
    # verl 0.9's reward.reward_model.* -> the legacy reward_model keys
    fold_reward_section(cfg, lambda path: resolve_path(path, base_dir))
    rm = cfg["reward_model"]
    rm["model"]["path"] = resolve_path(rm["model"]["path"], base_dir)
    rm["model"]["input_tokenizer"] = resolve_path(rm["model"]["input_tokenizer"], base_dir)
    rm["hot_swap"]["path"] = resolve_path(rm["hot_swap"]["path"], base_dir)
    cfg["critic"]["model"]["path"] = resolve_path(cfg["critic"]["model"]["path"], base_dir) or arr["model"]["path"]
    for key in ("rollout_data_dir", "validation_data_dir", "resume_from_path"):
        trainer[key] = resolve_path(trainer[key], base_dir) if trainer[key] else trainer[key]
    mt, agent = arr["rollout"]["multi_turn"], arr["rollout"]["agent"]
    for section, key in ((mt, "tool_config_path"), (mt, "function_tool_path"), (agent, "agent_loop_config_path")):
        section[key] = resolve_path(section[key], base_dir) if section[key] else section[key]
    cfg["hybrid_engine"]["bucket_bytes"] = reshard_bucket_bytes(cfg)
    # verl's deprecated global micro-batch sizes, when given, become per-GPU ones (as verl's workers do).
    dp = actor_dp_size(cfg)
    for section, key in ((arr["actor"], "ppo_micro_batch_size"), (arr["ref"], "log_prob_micro_batch_size"),
                         (arr["rollout"], "log_prob_micro_batch_size"), (cfg["critic"], "ppo_micro_batch_size"),
                         (cfg["reward_model"], "micro_batch_size")):
        if section.get(key) is not None:
            section[key + "_per_gpu"] = max(1, section[key] // dp)


def load_config(path: str | None = None, overrides: Sequence[str] = (), launcher_world_size: int | None = None,
                config_dir: str = PACKAGED_CONFIG_DIR, config_name: str | None = CONFIG_NAME,
                resolve_only: bool = False, data_pending: bool = False):
    """Packaged defaults (or ``config_dir/config_name``) <- YAML file ``path`` <- Hydra overrides, validated;
    returns an OmegaConf DictConfig. ``config_name=None``: the one verl's command line would compose
    (:func:`default_config_name`).

    Relative paths in the file (data files, tokenizer, model) resolve against the working directory
    first, then the repository root (the directory above ``configs/``). ``resolve_only`` stops after the
    types and ranges (what ``--cfg job`` prints), before the checks that read the model and data files.
    ``data_pending``: every check but the existence of the data files and the tokenizer, which an earlier
    stage of a pipeline writes (the quickstart checks its RL config before generating them).
    """
    from omegaconf import OmegaConf

    engine = chosen_engine(path, overrides)
    if config_name is None:
        config_name = default_config_name(path, engine)
    _register_engine_resolver()
    # The registries' names are checked once the user's modules (external_lib) have registered theirs.
    cfg, base_dir = compose(config_dir, config_name, path, overrides, rules_before_user_modules(RULES),
                            IGNORED_SECTIONS, SECTION_ALIASES)
    import_user_modules(cfg, RULES)
    _settle_engine(cfg, engine)
    defaults = named_defaults(PACKAGED_CONFIG_DIR, CONFIG_NAME)
    _warn_no_effect(cfg, defaults)
    _warn_other_backend(cfg, defaults)
    _derive(cfg, base_dir)
    if not resolve_only:
        _validate(cfg, launcher_world_size, data_pending)
    return OmegaConf.create(cfg)
