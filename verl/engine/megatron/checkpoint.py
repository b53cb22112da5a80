"""Megatron checkpoints with ``megatron.core.dist_checkpointing``: model, optimizer, LR scheduler,
RNG and iteration, loadable into a different (tp, pp).

Atomic (:func:`verl.utils.checkpoint.save_engine_checkpoint`): every rank writes into ``<dir>.tmp`` and
checksums and fsyncs its own files; after a barrier rank 0 records the file list, each file's size and CRC32 in
``verl_checkpoint.json`` and renames the directory, so a crash never leaves a half-written ``<dir>``. A full disk
inside dist_checkpointing's save (its writer processes report it without an errno) is a DiskFullError on every
rank.
Loading first checks that every recorded file is present, of its size and CRC32 (one clear error naming the
file; the CRC32 checks split over the ranks).

No process outlives the rank: dist_checkpointing's writer collects its results through a queue of a spawn-context
``multiprocessing.Manager`` it starts once per process and never stops (a server process re-importing ``__main__``,
~330 MB, left behind by every rank that ends with :func:`~verl.launcher.bootstrap.exit_process` or a kill). The saves
here are synchronous, so the queue's put and get both happen in the rank: :func:`_in_process_write_results` gives
the writer an in-process queue instead, and no Manager is started.

The engine calls this module (lazily, when it saves or loads); this module names the engine only as a type
(``TYPE_CHECKING``), so the two files form no import loop at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verl.utils.checkpoint import ENGINE_MANIFEST as MANIFEST  # noqa: F401 (its old home; tests import it)
from verl.utils.checkpoint import CheckpointError, rng_state, save_engine_checkpoint, set_rng_state
from verl.utils.checkpoint import read_engine_manifest as read_manifest

if TYPE_CHECKING:  # the engine imports this module when it saves: a type, not an import at run time
    from verl.engine.megatron.engine import MegatronEngine

# The distributed optimizer's default sharding cannot be saved on CPU ("flattened_range is not
# supported"); dp_reshardable can, and reloads under a different DP size.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _optimizers(engine: MegatronEngine):
    return getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])


def optimizer_has_state(engine: MegatronEngine) -> bool:
    """Whether Adam has state yet (it is created by the first step). An optimizer that never stepped
    (an actor still in ``trainer.critic_warmup``) has nothing to save, and megatron cannot save it."""
    return engine.optimizer is not None and any(len(getattr(optimizer, "optimizer", optimizer).state) > 0
                                                for optimizer in _optimizers(engine))


def _rng_sharded_object():
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = rng_state()
    pp, tp = mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", state, (pp, tp),
                         (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
                         replica_id=mpu.get_data_parallel_rank())


def _sharded_state(engine: MegatronEngine, with_optimizer: bool, is_loading: bool, with_rng: bool,
                   lora_only: bool = False):
    model_state = engine.module.sharded_state_dict()
    if engine.lora is not None:  # adapters sharded as their parameters (and alone with save_lora_only)
        from verl.engine.megatron.lora import adapter_sharded_state

        model_state = adapter_sharded_state(engine.module, model_state, lora_only)
    state = {"model": model_state}
    if with_optimizer and engine.optimizer is not None:
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
        state["scheduler"] = engine.scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_sharded_object()
    return state


def _in_process_write_results() -> None:
    """Have dist_checkpointing's (synchronous) writer collect its results in an in-process queue rather than a
    Manager's server process, which would outlive this rank (its module-level queue is created on first use)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:  # not yet created (and the name still there)
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(engine: MegatronEngine, path: str, iteration: int, with_optimizer: bool = True,
                    extra_manifest: dict | None = None, with_rng: bool = True) -> None:
    """Collective over every rank of the job; ``extra_manifest`` (JSON) is stored in the manifest.

    ``with_rng=False`` when the caller saves RNG itself (the RL trainer's ``rng/rank<r>.pt``), so a
    checkpoint holds each RNG once."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu

    # Never stepped: the optimizer and scheduler are as a fresh engine builds them; record that instead.
    fresh_optimizer = with_optimizer and engine.optimizer is not None and not optimizer_has_state(engine)
    with_optimizer = with_optimizer and not fresh_optimizer
    # save_lora_only: the adapters and their optimizer state (the optimizer holds nothing else); the frozen base
    # is the HF checkpoint the engine is built from on resume.
    lora_only = engine.lora is not None and bool(getattr(engine, "save_lora_only", False))

    def write(staging: str) -> None:
        state = _sharded_state(engine, with_optimizer, is_loading=False, with_rng=with_rng, lora_only=lora_only)
        state["iteration"] = iteration
        _in_process_write_results()
        dist_checkpointing.save(state, staging)

    def manifest(files: list[str]) -> dict:
        return {"iteration": iteration, "tp": mpu.get_tensor_model_parallel_world_size(),
                "pp": mpu.get_pipeline_model_parallel_world_size(), "head": engine.head,
                "with_optimizer": with_optimizer and engine.optimizer is not None,
                "fresh_optimizer": fresh_optimizer, "with_rng": with_rng, "lora_only": lora_only,
                "lora": _lora_record(engine),
                "model_config": engine.config.to_fields(), "files": files, **(extra_manifest or {})}

    save_engine_checkpoint(path, write, manifest)


def load_checkpoint(engine: MegatronEngine, path: str, with_optimizer: bool = True) -> int:
    """Load into ``engine`` (any tp/pp); returns the saved iteration. Collective over every rank."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu

    manifest = read_manifest(path)
    if manifest.get("strategy", "megatron") != "megatron":
        raise CheckpointError(f"checkpoint {path}: expected a Megatron checkpoint (strategy=megatron), found a "
                              f"{manifest['strategy']} one")
    if manifest["head"] != engine.head:
        raise CheckpointError(f"checkpoint {path}: expected a {engine.head!r} model, found {manifest['head']!r}")
    with_optimizer = with_optimizer and engine.optimizer is not None
    if with_optimizer and not manifest["with_optimizer"]:
        if not manifest.get("fresh_optimizer"):
            raise CheckpointError(f"checkpoint {path}: expected optimizer state, found a model-only checkpoint")
        if optimizer_has_state(engine) or engine.scheduler.num_steps:
            raise CheckpointError(f"checkpoint {path}: expected an engine that never stepped (the checkpoint's "
                                  f"optimizer never did), found one at step {engine.scheduler.num_steps}")
        with_optimizer = False  # saved before its first step: this engine's fresh optimizer is that state
    same_layout = (manifest["tp"], manifest["pp"]) == (mpu.get_tensor_model_parallel_world_size(),
                                                       mpu.get_pipeline_model_parallel_world_size())
    if with_optimizer:
        for optimizer in _optimizers(engine):
            if hasattr(optimizer, "_init_optimizer_states_with_dummy_values"):
                # A fresh distributed optimizer has no Adam state to load into yet.
                optimizer._init_optimizer_states_with_dummy_values()
    lora_only = _check_lora(engine, manifest, path)
    restore_rng = same_layout and manifest.get("with_rng", True)
    state = _sharded_state(engine, with_optimizer, is_loading=True, with_rng=restore_rng, lora_only=lora_only)
    loaded = dist_checkpointing.load(state, path)
    if lora_only:  # the base stays as loaded from the HF checkpoint
        from verl.engine.lora import trained_names

        result = engine.module.load_state_dict(loaded["model"], strict=False)
        missing = sorted(trained_names(engine.module).intersection(result.missing_keys))
        if missing or result.unexpected_keys:
            raise CheckpointError(f"checkpoint {path}: expected this model's adapters, found "
                                  f"{len(missing)} missing and {len(result.unexpected_keys)} unknown")
    else:
        engine.module.load_state_dict(loaded["model"])
    if with_optimizer:
        with torch.no_grad():  # fp32 main params of the distributed optimizer are views of leaf params
            engine.optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(engine, manifest["iteration"])
        engine.scheduler.load_state_dict(loaded["scheduler"])
    if restore_rng:
        set_rng_state(loaded["rng_state"])
    return int(manifest["iteration"])


def _lora_record(engine: MegatronEngine) -> dict | None:
    from verl.engine.lora import lora_record

    return lora_record(engine.lora, getattr(engine, "base_fingerprint", None))


def _check_lora(engine: MegatronEngine, manifest: dict, path: str) -> bool:
    """Whether ``path`` holds adapters only; a LoRA checkpoint needs an engine with the same LoRA (and adapters
    alone, the same base)."""
    from verl.engine.lora import check_lora_record

    lora_only = bool(manifest.get("lora_only"))
    check_lora_record(manifest.get("lora"), _lora_record(engine), lora_only, path,
                      getattr(engine, "base_model_path", None))
    return lora_only


def _unshare_adam_steps(engine: MegatronEngine, iteration: int) -> None:
    """megatron loads one 'step' tensor shared by every param; Adam then bumps it once per param."""
    for optimizer in _optimizers(engine):
        for param_state in optimizer.optimizer.state.values():
            if "step" in param_state:
                step = param_state["step"]
                param_state["step"] = torch.full_like(step, float(iteration)) if torch.is_tensor(step) else iteration

