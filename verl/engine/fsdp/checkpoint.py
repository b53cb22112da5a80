"""FSDP checkpoints with ``torch.distributed.checkpoint`` (DCP): model and optimizer as sharded tensors, the
LR schedule and the optimizer step count in the manifest; loadable at another world size or ``fsdp_size``
(DCP reshards on load).

Atomic as the Megatron checkpoints, through :func:`verl.utils.checkpoint.save_engine_checkpoint`: every rank
writes into ``<dir>.tmp`` and checksums and fsyncs its own files; after a barrier rank 0 writes
``verl_checkpoint.json`` (the file list, each file's size and CRC32) and renames the directory, so a crash never
leaves a half-written ``<dir>``; a full disk inside DCP's save is a DiskFullError on every rank. Loading checks
every file's CRC32 first (split over the ranks). RNG states are the trainer's (``rng/``).

The engine calls this module (lazily, when it saves or loads); this module names the engine only as a type
(``TYPE_CHECKING``), so the two files form no import loop at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from verl.engine.lora import check_lora_record, lora_record
from verl.models.config import ModelConfig
from verl.utils.checkpoint import CheckpointError, save_engine_checkpoint
from verl.utils.checkpoint import read_engine_manifest as read_manifest

if TYPE_CHECKING:  # the engine imports this module when it saves: a type, not an import at run time
    from verl.engine.fsdp.engine import FSDPEngine

STRATEGY = "fsdp"


def _state(engine: FSDPEngine, with_optimizer: bool, lora_only: bool = False) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = get_model_state_dict(engine.model)
    if lora_only:  # the adapters (PEFT's names) and a critic's value head; the frozen base is the HF checkpoint
        from verl.engine.lora import trained_names

        trained = trained_names(engine.model)
        model = {k: v for k, v in model.items() if k in trained}
    state = {"model": model}
    if with_optimizer:
        state["optimizer"] = get_optimizer_state_dict(engine.model, engine.optimizer)
    return state


def save_checkpoint(engine: FSDPEngine, path: str, iteration: int, with_optimizer: bool = True) -> None:
    """Collective over every rank of the job."""
    import torch.distributed.checkpoint as dcp

    # An optimizer that never stepped has no state: a fresh engine's optimizer is that state.
    fresh_optimizer = with_optimizer and engine.optimizer is not None and not engine.optimizer.state
    with_optimizer = with_optimizer and engine.optimizer is not None and not fresh_optimizer
    # save_lora_only: adapters and their optimizer state (AdamW holds the adapters alone)
    lora_only = engine.lora is not None and bool(getattr(engine, "save_lora_only", False))
    lora = lora_record(engine.lora, getattr(engine, "base_fingerprint", None))

    def manifest(files: list[str]) -> dict:
        return {"strategy": STRATEGY, "iteration": iteration, "world_size": dist.get_world_size(),
                "fsdp_size": engine.mesh.shard_size, "head": engine.head, "with_optimizer": with_optimizer,
                "fresh_optimizer": fresh_optimizer, "with_rng": False, "lora_only": lora_only, "lora": lora,
                "scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
                "model_config": engine.config.to_fields(), "files": files}

    save_engine_checkpoint(path, lambda staging: dcp.save(_state(engine, with_optimizer, lora_only),
                                                          checkpoint_id=staging), manifest)


def load_checkpoint(engine: FSDPEngine, path: str, with_optimizer: bool = True) -> int:
    """Load into ``engine`` (any world size); returns the saved iteration. Collective over every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    manifest = read_manifest(path)
    if manifest.get("strategy") != STRATEGY:
        raise CheckpointError(f"checkpoint {path}: expected an FSDP checkpoint (actor.strategy=fsdp), found a "
                              f"{manifest.get('strategy', 'megatron')} one")
    if manifest["head"] != engine.head:
        raise CheckpointError(f"checkpoint {path}: expected a {engine.head!r} model, found {manifest['head']!r}")
    # Fields a manifest predates take their defaults (a dense model's), so older checkpoints still resume.
    if ModelConfig.from_fields(manifest["model_config"]) != engine.config:
        raise CheckpointError(f"checkpoint {path}: expected the model of {engine.config.model_type} hidden "
                              f"{engine.config.hidden_size} x {engine.config.num_hidden_layers} layers, found "
                              f"another model config")
    lora = lora_record(engine.lora, getattr(engine, "base_fingerprint", None))
    lora_only = bool(manifest.get("lora_only"))
    check_lora_record(manifest.get("lora"), lora, lora_only, path, getattr(engine, "base_model_path", None))
    with_optimizer = with_optimizer and engine.optimizer is not None
    if with_optimizer and not manifest["with_optimizer"]:
        if not manifest.get("fresh_optimizer"):
            raise CheckpointError(f"checkpoint {path}: expected optimizer state, found a model-only checkpoint")
        if engine.optimizer.state:
            raise CheckpointError(f"checkpoint {path}: expected an engine that never stepped (the checkpoint's "
                                  f"optimizer never did), found one at step {engine.optimizer_steps}")
        with_optimizer = False
    state = _state(engine, with_optimizer, lora_only)
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as exc:  # DCP raises a CheckpointException wrapping each rank's error
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path}: expected readable DCP shards, found {first[:300]}") from None
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # adapters only: the base keeps the HF checkpoint's values it was built with
    set_model_state_dict(engine.model, state["model"], options=StateDictOptions(strict=not lora_only))
    if with_optimizer:
        set_optimizer_state_dict(engine.model, engine.optimizer, state["optimizer"])
    if engine.scheduler is not None and manifest.get("scheduler"):
        engine.scheduler.load_state_dict(manifest["scheduler"])
    return int(manifest["iteration"])
