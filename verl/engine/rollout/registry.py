"""The rollout engines by name (``actor_rollout_ref.rollout.name``, ``verl generate --engine``).

Each engine is one :class:`RolloutEngine` registration: what it can do (:class:`RolloutCapabilities`, read by
the config check, the preflight and the roles instead of its name), how the trainer builds it on a rollout TP
group (``build``: the colocated actor worker and the standalone rollout pool call the same one), how
``verl generate`` opens it on an HF checkpoint (``open_standalone``), and the model limits it checks before
anything starts (``check_model``). Adding an engine is one :func:`register_rollout` call.

This module imports nothing heavy (the config check reads it before torch and the engines load): the engines'
modules are imported inside their builders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from verl.utils.config_checks import ConfigError


@dataclasses.dataclass(frozen=True)
class RolloutCapabilities:
    """What an engine declares; every check that used to compare the engine's name reads one of these."""

    group_backend: str | None   # the rollout TP group's process-group backend; None: the job's own (by device)
    vocab_padding: int          # the vocab table's rows padded to a multiple of this (the rollout layout's 64)
    moe_weights: bool           # takes a mixture-of-experts model's weights from the reshard
    routing_recording: bool     # records the routed experts of every token (routing replay R3)
    partial_rollout: bool       # generates in segments that stop early and resume on new weights (async modes)
    # serves verl's agent loops token in / token out (``token_server``; rollout.multi_turn.enable)
    agent_loop: bool = False
    # its token server's turns report the model version that sampled them (``version``/``versions``), so agent
    # loops can run across the colocated asynchronous trainer's steps (rollout.multi_turn with colocate_async)
    agent_loop_async: bool = False
    # runs only where this package imports: its own environment (verl.utils.engine_env.ENGINE_ENVS); None: anywhere
    python_env: str | None = None


CAPABILITIES = tuple(f.name for f in dataclasses.fields(RolloutCapabilities))


@dataclasses.dataclass(frozen=True)
class RolloutSite:
    """Where the trainer builds an engine: this rank's place in its rollout TP group and what it will serve."""

    model_config: Any            # verl.models.config.ModelConfig
    model_path: str              # the actor's HF directory or config.json
    tp_group: Any                # the process group over ``group_ranks`` (None: this rank alone)
    group_ranks: tuple[int, ...]  # the group's global ranks in rollout TP order
    replica: int                 # the rollout DP rank (replica index) of the group
    pad_token_id: int
    seed: int
    bucket_bytes: int            # the reshard's bucket (hybrid_engine.bucket_bytes): an engine's push bucket too
    max_rows: int                # the most responses this replica generates in one call
    max_seq_len: int             # prompt + response
    pool: bool = False           # a standalone rollout pool: the engine keeps its memory between calls


@dataclasses.dataclass(frozen=True)
class StandaloneSite:
    """``verl generate``: one engine over ``tp_size`` ranks on an HF checkpoint, no trainer."""

    model_config: Any
    model_dir: str
    tp_size: int
    tp_group: Any                # the ranks' process group for an SPMD engine (None: one rank, or own processes)
    dtype: str                   # a name of verl.utils.torch_dtypes.DTYPES
    pad_token_id: int
    seed: int
    max_rows: int
    max_seq_len: int


@dataclasses.dataclass(frozen=True)
class RolloutEngine:
    """One registration. ``build(rollout_section, site)`` -> the trainer's engine on this rank;
    ``open_standalone(site)`` -> a context manager yielding an engine with the checkpoint's weights loaded;
    ``check_model(model_config, tp_size)`` raises an InputError for a model or TP the engine cannot run
    (None: the rollout layout's own check is all); ``lacks``: why the engine lacks a capability it does not
    declare (said with the refusal)."""

    name: str
    capabilities: RolloutCapabilities
    build: Callable[[Any, RolloutSite], Any]
    open_standalone: Callable[[StandaloneSite], contextlib.AbstractContextManager]
    check_model: Callable[[Any, int], None] | None = None
    lacks: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.lacks) - set(CAPABILITIES))
        if unknown:
            raise ValueError(f"rollout engine {self.name!r}: expected capabilities in lacks, found {unknown}")


class UnknownRolloutEngineError(ConfigError):
    """A rollout engine name nothing registered."""


class RolloutCapabilityError(ConfigError):
    """A config asks a rollout engine for something it does not declare."""


_ENGINES: dict[str, RolloutEngine] = {}

# Rollout names verl configs use that no engine here serves: refused by the config check with the reason.
REFUSED_ROLLOUT_NAMES: dict[str, str] = {
    "hf": "verl-hpc's rollouts are native, sglang and vllm: use native",
    "trtllm": "verl-hpc's rollouts are native, sglang and vllm: use native",
}


def register_rollout(engine: RolloutEngine, *, replace: bool = False) -> RolloutEngine:
    """Add ``engine`` under its name (``replace``: over an existing registration); returns it."""
    from verl.models.rollout_shapes import ROLLOUT_VOCAB_PADDING

    if engine.name in _ENGINES and not replace:
        raise ValueError(f"rollout engine {engine.name!r}: already registered (pass replace=True)")
    # Both sides of the reshard read one rollout layout, so every engine must hold the vocab rows it pads.
    if engine.capabilities.vocab_padding != ROLLOUT_VOCAB_PADDING:
        raise ValueError(f"rollout engine {engine.name!r}: expected vocab_padding={ROLLOUT_VOCAB_PADDING} (the "
                         f"rollout layout the reshard writes), found {engine.capabilities.vocab_padding}")
    _ENGINES[engine.name] = engine
    return engine


def unregister_rollout(name: str) -> None:
    """Remove a registration (a test's engine); the built-in ones stay."""
    if name in BUILTIN_ROLLOUTS:
        raise ValueError(f"rollout engine {name!r}: a built-in engine cannot be unregistered")
    _ENGINES.pop(name, None)


def rollout_names() -> tuple[str, ...]:
    """The registered engines' names, in registration order."""
    return tuple(_ENGINES)


def rollout_engine(name: str, key: str = "actor_rollout_ref.rollout.name") -> RolloutEngine:
    """The engine registered as ``name``; an unknown one is one line naming ``key`` and the registered names."""
    try:
        return _ENGINES[name]
    except KeyError:
        raise UnknownRolloutEngineError(f"{key}: expected a registered rollout engine, one of "
                                        f"{', '.join(_ENGINES)}, found {name!r}") from None


def rollout_capabilities(name: str) -> RolloutCapabilities:
    return rollout_engine(name).capabilities


def require_capability(name: str, capability: str, needed_for: str, key: str = "actor_rollout_ref.rollout.name"
                       ) -> None:
    """Raise one line naming the engine and the capability when engine ``name`` does not declare
    ``capability``, which ``needed_for`` (the setting that asks for it) needs."""
    if capability not in CAPABILITIES:
        raise ValueError(f"capability: expected one of {CAPABILITIES}, found {capability!r}")
    engine = rollout_engine(name, key)
    if getattr(engine.capabilities, capability):
        return
    why = engine.lacks.get(capability)
    raise RolloutCapabilityError(f"{key}={name}: the rollout engine {name!r} lacks the capability {capability}, "
                                 f"which {needed_for} needs" + (f" ({why})" if why else ""))


class RolloutNameChoices(Sequence):
    """The values ``rollout.name`` may take, read when a config is checked (not when the rule was made), so an
    engine registered after import is accepted: the registered names, then the names refused with a reason."""

    def _names(self) -> tuple[str, ...]:
        return rollout_names() + tuple(n for n in REFUSED_ROLLOUT_NAMES if n not in _ENGINES)

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


ROLLOUT_NAME_CHOICES = RolloutNameChoices()


# --------------------------------------------------------------------------- the built-in engines
def _dtype(name: str):
    from verl.utils.torch_dtypes import DTYPES

    return DTYPES[name]


def _build_native(rollout: Any, site: RolloutSite) -> Any:
    from verl.engine.rollout.native.engine import NativeRollout

    engine = NativeRollout(site.model_config, tp_group=site.tp_group, dtype=_dtype(rollout.dtype),
                           pad_token_id=site.pad_token_id)
    engine.record_routing = bool(rollout.enable_rollout_routing_replay)
    # verl's enable_prefix_caching (the trainer's rollout section; generation jobs run no agent turns): agent turns
    # keep their trajectory's K/V, at most one full batch's worth
    engine.prefix_caching = bool(getattr(rollout, "enable_prefix_caching", True))
    engine.prefix_cache_tokens = site.max_rows * site.max_seq_len
    return engine


def _open_native(site: StandaloneSite) -> contextlib.AbstractContextManager:
    from verl.engine.rollout.native.engine import NativeRollout

    engine = NativeRollout(site.model_config, tp_group=site.tp_group, dtype=_dtype(site.dtype),
                           pad_token_id=site.pad_token_id)
    engine.load_hf_checkpoint(site.model_dir)
    return contextlib.nullcontext(engine)


def _build_sglang(rollout: Any, site: RolloutSite) -> Any:
    """One SGLang engine per rollout TP group, owned by the group's first rank (see sglang_group)."""
    from verl.engine.rollout.sglang_group import SGLangGroupRollout
    from verl.launcher.env import discover

    local_groups = max(1, discover().local_world_size // len(site.group_ranks))
    return SGLangGroupRollout(
        site.model_config, site.model_path, site.group_ranks, site.tp_group, dtype=_dtype(rollout.dtype),
        bucket_bytes=site.bucket_bytes, pad_token_id=site.pad_token_id, seed=site.seed,
        group_index=site.replica % local_groups, num_groups=local_groups, max_rows=site.max_rows,
        max_seq_len=site.max_seq_len, mem_fraction_static=rollout.gpu_memory_utilization,
        # A pool generates again right after the next sync: it keeps its memory.
        free_cache_engine=bool(rollout.free_cache_engine) and not site.pool,
        engine_kwargs=dict(rollout.engine_kwargs.sglang))


def _open_sglang(site: StandaloneSite) -> contextlib.AbstractContextManager:
    from verl.engine.rollout.sglang_rollout import SGLangRollout, kv_pool_tokens

    return SGLangRollout(site.model_config, os.path.abspath(site.model_dir), tp_size=site.tp_size,
                         dtype=_dtype(site.dtype), pad_token_id=site.pad_token_id, seed=site.seed,
                         max_total_tokens=kv_pool_tokens(site.max_rows, site.max_seq_len))


def _check_sglang_model(config: Any, tp_size: int) -> None:
    from verl.engine.rollout.sglang_rollout import check_cpu_tp, check_sglang_model
    from verl.utils.device import is_cuda_available

    check_sglang_model(config)
    if not is_cuda_available():
        check_cpu_tp(config, tp_size)


NATIVE = RolloutEngine(
    "native",
    RolloutCapabilities(group_backend=None, vocab_padding=64, moe_weights=True, routing_recording=True,
                        partial_rollout=True, agent_loop=True, agent_loop_async=True),
    build=_build_native, open_standalone=_open_native,
)
SGLANG = RolloutEngine(
    "sglang",
    # The group's collectives only move handles between its ranks: gloo, whatever the training backend.
    RolloutCapabilities(group_backend="gloo", vocab_padding=64, moe_weights=False, routing_recording=False,
                        partial_rollout=True, agent_loop=True, agent_loop_async=True,
                        python_env="sglang"),
    build=_build_sglang, open_standalone=_open_sglang, check_model=_check_sglang_model,
    lacks={"moe_weights": "pushing the stacked experts into SGLang's fused-MoE weights is not wired yet; "
                          "`verl generate --engine sglang` runs the checkpoint: use native",
           "routing_recording": "the native engine records routing here: use native"},
)


def _vllm_engine(site: Any, model_path: str, dtype: str, load_format: str, engine_args: dict,
                 worker_tp: int = 1) -> Any:
    from verl.engine.rollout.vllm.engine import VLLMRollout

    return VLLMRollout(site.model_config, model_path, dtype=_dtype(dtype), pad_token_id=site.pad_token_id,
                       seed=site.seed, max_rows=site.max_rows, max_seq_len=site.max_seq_len, load_format=load_format,
                       engine_args=engine_args, tp_group=site.tp_group, worker_tp=worker_tp)


def vllm_engine_args(rollout: Any, max_rows: int) -> dict[str, Any]:
    """verl's vLLM keys of the rollout section as vLLM's engine arguments (``engine_kwargs.vllm`` goes on top, as verl
    passes it). ``max_num_seqs`` is capped by the rows a call generates (the KV pool is sized for those);
    ``max_model_len`` null keeps prompt + response; ``gpu_memory_utilization`` only on a GPU (vLLM's CPU backend
    reads it as the fraction of host memory to reserve: the KV pool here is sized by VLLM_CPU_KVCACHE_SPACE)."""
    from verl.utils.device import is_cuda_available

    args = dict(enforce_eager=bool(rollout.enforce_eager), enable_prefix_caching=bool(rollout.enable_prefix_caching),
                max_num_batched_tokens=int(rollout.max_num_batched_tokens),
                enable_chunked_prefill=bool(rollout.enable_chunked_prefill),
                disable_log_stats=bool(rollout.disable_log_stats),
                max_num_seqs=max(1, min(int(rollout.max_num_seqs), max_rows)))
    if rollout.max_model_len is not None:
        args["max_model_len"] = int(rollout.max_model_len)
    if is_cuda_available():
        args["gpu_memory_utilization"] = float(rollout.gpu_memory_utilization)
    return args


def _build_vllm(rollout: Any, site: RolloutSite) -> Any:
    """vLLM in this rank's process, one TP worker per rank of the rollout TP group (vLLM's external launcher); its
    weights arrive from the reshard at the first sync."""
    import tempfile

    from verl.engine.rollout.sglang_group import engine_model_dir
    from verl.engine.rollout.vllm.engine import VLLMConfigError

    if site.pool and site.tp_group is not None:  # vLLM builds its groups over every rank; the trainer's build none
        raise VLLMConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={len(site.group_ranks)}: a "
                              "standalone rollout pool runs vLLM at TP 1 (vLLM's external launcher builds its TP "
                              "groups over every rank of the job, the training ranks included): use 1, or "
                              "rollout.name=native")

    model_dir = engine_model_dir(site.model_path, tempfile.mkdtemp(prefix="verl_vllm_model_"))
    args = vllm_engine_args(rollout, site.max_rows)
    args.update(dict(rollout.engine_kwargs.vllm))
    return _vllm_engine(site, model_dir, rollout.dtype, "dummy", args)


def _open_vllm(site: StandaloneSite) -> contextlib.AbstractContextManager:
    # one process here, vLLM's own TP worker processes under it (shut down at the exit)
    return _vllm_engine(site, os.path.abspath(site.model_dir), site.dtype, "auto", {}, worker_tp=site.tp_size)


def _check_vllm_model(config: Any, tp_size: int) -> None:
    from verl.engine.rollout.vllm.engine import check_vllm_model

    check_vllm_model(config, tp_size)


VLLM = RolloutEngine(
    "vllm",
    RolloutCapabilities(group_backend=None, vocab_padding=64, moe_weights=True, routing_recording=False,
                        partial_rollout=True, agent_loop=True, agent_loop_async=True, python_env="vllm"),
    build=_build_vllm, open_standalone=_open_vllm, check_model=_check_vllm_model,
    lacks={"routing_recording": "the native engine records routing here: use native"},
)
BUILTIN_ROLLOUTS = ("native", "sglang", "vllm")
# checked against the layout by the unit tests
_ENGINES.update({NATIVE.name: NATIVE, SGLANG.name: SGLANG, VLLM.name: VLLM})


def rollout_python_env(name: str) -> str | None:
    """The environment engine ``name`` must run in (its package's name), None for any Python or an unknown name."""
    engine = _ENGINES.get(name)
    return None if engine is None else engine.capabilities.python_env


__all__ = ["BUILTIN_ROLLOUTS", "CAPABILITIES", "REFUSED_ROLLOUT_NAMES", "ROLLOUT_NAME_CHOICES", "RolloutCapabilities",
           "RolloutCapabilityError", "RolloutEngine", "RolloutSite", "StandaloneSite", "UnknownRolloutEngineError",
           "register_rollout", "require_capability", "rollout_capabilities", "rollout_engine", "rollout_names",
           "rollout_python_env", "unregister_rollout"]
