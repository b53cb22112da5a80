"""Trainer checkpoints: one directory per saved step, written atomically, found again by ``resume_mode``.

    <default_local_dir>/global_step_<N>/
        actor/  critic/            Megatron model + optimizer + scheduler (engine/megatron/checkpoint.py)
        trainer_state.json         step, dataloader sampler state, KL controller (rank 0)
        rng/rank<r>.pt             python / numpy / torch RNG of every rank
    <default_local_dir>/latest_checkpointed_iteration.txt   (verl's name) the newest complete step

``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` (:func:`prune_checkpoints`): after each
save the actor / critic parts of older checkpoints beyond the newest N are deleted.

Atomic: every part is written under ``global_step_<N>.tmp``; after a barrier rank 0 renames it and
only then updates ``latest_checkpointed_iteration.txt`` (itself written to a temp file and renamed),
so a run killed at any instant leaves either the previous or the new checkpoint, never a torn one.
Staging directories a killed run left behind are removed at the next save.
Durable: every file and directory is fsynced before the rename that publishes a checkpoint, and the manifest
holds a CRC32 of each small file (:data:`CHECKSUM_MAX_BYTES`), checked with the sizes whenever a checkpoint is
judged complete.

Disk space: a save needs room for one more checkpoint beside the kept ones (the old ones are pruned only once
the new one is complete). Before writing, rank 0 compares the free space with the newest complete checkpoint's
size; when it is short, older checkpoints beyond ``max_to_keep - 1`` are pruned first (never the newest complete
one), and if that is not enough the save is refused up front. A file system that fills up during the save anyway
(``ENOSPC``/``EDQUOT`` on any rank) ends in :class:`DiskFullError`: one line naming the last complete checkpoint,
with the staging directory removed.
The engines' parts (``actor/``, ``critic/``) are staged and renamed the same way by
:func:`save_engine_checkpoint`, with their own manifest ``verl_checkpoint.json``.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import sys
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.errors import InputError
from verl.utils.logging_utils import get_logger

logger = get_logger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "verl_trainer_manifest.json"  # every file with its size (small ones' CRC32 too), written last
# Files up to this size get a CRC32 in the manifest, checked whenever a checkpoint is judged complete (resume,
# pruning): the trainer state, every rank's RNG, the engines' manifests and Megatron's metadata -- the files that
# decide what a resume does, a few KB each. The model and optimizer shards (tens of GB) get their size only:
# Megatron's writer gives no hook to checksum while it writes, so a checksum would read every shard back after
# each save (doubling its I/O) and again at every completeness check. Their durability comes from the fsync of
# every file before the rename, their truncation shows in the size.
CHECKSUM_MAX_BYTES = 1 << 20
ENGINE_MANIFEST = "verl_checkpoint.json"  # an engine checkpoint's (actor/, critic/) file list and layout


class CheckpointError(InputError):
    """A checkpoint (trainer resume target, Megatron checkpoint or HF model directory) that is missing,
    incomplete, corrupt, or for another model: the one error class for every checkpoint reader."""


class DiskFullError(RuntimeError):
    """The file system ran out of space or quota while a checkpoint was written: neither bad input nor a bug.
    Its message is one line naming the last complete checkpoint; nothing of the failed save is left."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SPACE_HEADROOM = 1.05  # a checkpoint's size varies a little from step to step (JSON state, manifests)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _megatron_rng_tracker():
    """Megatron's model-parallel RNG tracker when this process initialised Megatron, else None."""
    if "megatron.core.parallel_state" not in sys.modules:  # never initialised here (the FSDP backend)
        return None
    try:
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
    except ImportError:
        return None
    return get_cuda_rng_tracker() if mpu.model_parallel_is_initialized() else None


def rng_state() -> dict[str, Any]:
    """Every RNG of this process (python, numpy, torch, Megatron's tracker), in types that
    ``torch.load(weights_only=True)`` reads back: the one RNG snapshot of every checkpoint."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "numpy": [name, torch.from_numpy(keys.astype(np.int64)),
                                                                   pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    tracker = _megatron_rng_tracker()
    if tracker is not None:
        state["megatron_tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    tracker = _megatron_rng_tracker()
    if tracker is not None and "megatron_tracker" in state:
        tracker.set_states(state["megatron_tracker"])


def fsync_path(path: str) -> None:
    """Flush ``path`` (a file or a directory: its entries) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (each directory after its contents). Before the rename that
    publishes a checkpoint: without it a crash of the node soon after could leave a published (and ``latest``)
    checkpoint whose files were never written out -- sizes right, contents zeros."""
    for root, _, names in os.walk(path, topdown=False):
        for name in names:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def save_trainer_checkpoint(root: str, step: int, trainer_state: dict[str, Any],
                            save_models: Callable[[str], None],
                            max_to_keep: dict[str, int | None] | None = None) -> str:
    """Collective: ``save_models(staging_dir)`` writes the workers' parts; returns the final directory.
    ``max_to_keep`` (the trainer's ``max_*_ckpt_to_keep``) lets a save that lacks room prune first."""
    final = step_dir(root, step)
    staging = final + ".tmp"
    problem = None
    if _rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            clean_stale_staging(root)
            problem = _make_room(root, step, max_to_keep or {})
            if problem is None:
                os.makedirs(os.path.join(staging, "rng"))
        except OSError as err:
            problem = _disk_full_or_raise(err)
    _agree(problem, root, step, staging)
    try:
        save_models(staging)
        torch.save(rng_state(), os.path.join(staging, "rng", f"rank{_rank()}.pt"))
        if _rank() == 0:
            with open(os.path.join(staging, STATE_FILE), "w", encoding="utf-8") as fh:
                json.dump({"step": step, **trainer_state}, fh, indent=2)
    except OSError as err:
        problem = _disk_full_or_raise(err)
    except DiskFullError as err:  # an engine's own staged save ran out of space
        problem = str(err)
    _agree(problem, root, step, staging)
    if _rank() == 0:
        try:
            write_manifest(staging)  # last: a checkpoint without it (or not matching it) is incomplete
            _replace_dir(staging, final)
            fsync_path(root)  # the rename is durable before `latest` names it
            latest = os.path.join(root, LATEST_FILE)
            with open(latest + ".tmp", "w", encoding="utf-8") as fh:
                fh.write(f"{step}\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(latest + ".tmp", latest)
            fsync_path(root)
        except OSError as err:
            problem = _disk_full_or_raise(err)
            if os.path.isdir(final) and checkpoint_problem(final) is not None:
                shutil.rmtree(final, ignore_errors=True)  # renamed but its `latest` pointer failed: not kept
    _agree(problem, root, step, staging)
    return final


def clean_stale_staging(root: str) -> list[str]:
    """Remove the ``global_step_<N>.tmp`` directories and ``latest`` temp file a killed save left under ``root``
    (rank 0, before a save; nothing else writes there then). Returns what was removed."""
    removed = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if name.startswith("global_step_") and name.endswith(".tmp") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif name == LATEST_FILE + ".tmp":
            os.remove(path)
            removed.append(path)
    if removed:
        logger.warning("checkpoints: removed staging left by an interrupted save: %s", ", ".join(removed))
    return removed


def _checkpoint_bytes(path: str) -> int:
    """A complete checkpoint's size: its manifest's sum when it has one, else the files on disk."""
    try:
        with open(os.path.join(path, MANIFEST_FILE), encoding="utf-8") as fh:
            return sum(int(v) for v in json.load(fh)["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return sum(os.path.getsize(os.path.join(r, f)) for r, _, names in os.walk(path) for f in names)


def _make_room(root: str, step: int, max_to_keep: dict[str, int | None]) -> str | None:
    """None when the file system of ``root`` has room for a checkpoint as large as the newest complete one,
    after pruning to ``max_to_keep - 1`` if needed; else the one-line reason the save cannot start."""
    complete = _complete_checkpoints(root)
    if not complete:
        return None
    needed = int(_checkpoint_bytes(complete[0]) * SPACE_HEADROOM)
    free = shutil.disk_usage(root).free
    if free >= needed:
        return None
    tighter = {part: max(1, keep - 1) for part, keep in max_to_keep.items() if keep is not None}
    if tighter:
        newest = int(complete[0].rpartition("_")[2])
        removed = prune_checkpoints(root, newest, tighter)
        free = shutil.disk_usage(root).free
        if removed:
            logger.warning("checkpoints: %s free for a %s checkpoint: pruned %s before saving step %d",
                           _size(free), _size(needed), ", ".join(removed), step)
        if free >= needed:
            return None
    return (f"expected {_size(needed)} free for it (the size of {complete[0]}), found {_size(free)}; "
            f"free space or lower trainer.max_actor_ckpt_to_keep/max_critic_ckpt_to_keep")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _disk_full_or_raise(err: OSError) -> str:
    if err.errno not in DISK_FULL_ERRNOS:
        raise err
    return f"{os.strerror(err.errno)} writing {err.filename or 'a file'}"


def _agree(problem: str | None, root: str, step: int | None, staging: str) -> None:
    """Collective: every rank learns whether any rank's part of the save failed for lack of space; then each
    raises :class:`DiskFullError` (rank 0 first removes the staging directory) or all go on."""
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not failed:
        return
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    rank, why = failed[0]
    if step is None:  # an engine's part (actor/, critic/ or a standalone `verl convert` output)
        raise DiskFullError(f"checkpoint {staging[:-len('.tmp')]} not saved: rank {rank}: {why}; nothing of it "
                            f"was kept")
    last = _complete_checkpoints(root)
    raise DiskFullError(f"checkpoint of step {step} not saved: rank {rank}: {why}; nothing of it was kept; the "
                        f"last complete checkpoint is {last[0] if last else 'none'}")


def _replace_dir(staging: str, final: str) -> None:
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(staging, final)


def save_engine_checkpoint(path: str, write: Callable[[str], None],
                           manifest: Callable[[list[str]], dict[str, Any]]) -> None:
    """An engine's (Megatron, FSDP) checkpoint, atomically. Collective over every rank of the job: each rank's
    ``write(staging)`` fills ``<path>.tmp``; after a barrier rank 0 stores ``manifest(files)`` (every file
    written, relative and sorted) as :data:`ENGINE_MANIFEST` and renames the directory to ``path``, replacing
    an older one, so a crash never leaves a half-written ``path``."""
    path = os.path.abspath(path)
    staging = path + ".tmp"
    problem = None
    try:
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
    except OSError as err:
        problem = _disk_full_or_raise(err)
    _agree(problem, os.path.dirname(path), None, staging)
    try:
        write(staging)
    except OSError as err:  # out of space on this rank: every rank hears of it below instead of hanging
        problem = _disk_full_or_raise(err)
    _agree(problem, os.path.dirname(path), None, staging)
    try:
        if dist.get_rank() == 0:
            files = sorted(os.path.relpath(os.path.join(root, f), staging)
                           for root, _, names in os.walk(staging) for f in names)
            with open(os.path.join(staging, ENGINE_MANIFEST), "w", encoding="utf-8") as fh:
                json.dump(manifest(files), fh, indent=2)
            fsync_tree(staging)  # every rank's files are closed (barrier above): flushed before they are published
            _replace_dir(staging, path)
            fsync_path(os.path.dirname(path))
    except OSError as err:
        problem = _disk_full_or_raise(err)
    _agree(problem, os.path.dirname(path), None, staging)


def read_engine_manifest(path: str) -> dict:
    """The engine checkpoint's manifest, after checking every file it lists is present."""
    file = os.path.join(path, ENGINE_MANIFEST)
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path}: expected {ENGINE_MANIFEST}, found it missing")
    with open(file, encoding="utf-8") as fh:
        manifest = json.load(fh)
    for name in manifest["files"]:
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path}: expected file {name}, found it missing")
    return manifest


def prune_checkpoints(root: str, current_step: int, max_to_keep: dict[str, int | None]) -> list[str]:
    """verl's ``max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` after a save (rank 0): for each part
    (``actor``, ``critic``) with a limit N, keep it in the N newest complete checkpoints at or before
    ``current_step`` that hold it, and delete it from every older one, as verl deletes each role's old
    directories. A checkpoint left without an actor and a critic is removed whole. Never touched: the
    checkpoint of ``current_step``, the one auto-resume would pick, incomplete checkpoints newer than the
    oldest one kept, and checkpoints after ``current_step`` (left by a run resumed from further back).
    A checkpoint that lost a part is no longer complete (its manifest names the part), so nothing
    resumes from it. Returns the paths deleted."""
    protected = {step_dir(root, current_step), find_resume_dir(root, "auto")}
    steps = sorted((int(name.rpartition("_")[2]) for name in os.listdir(root) if os.path.isdir(os.path.join(root, name))
                    and name.rpartition("_")[0] == "global_step" and name.rpartition("_")[2].isdigit()),
                   reverse=True) if os.path.isdir(root) else []
    steps = [s for s in steps if s <= current_step]
    complete = {s for s in steps if checkpoint_problem(step_dir(root, s)) is None}
    removed = []
    for part, keep in max_to_keep.items():
        if keep is None:
            continue
        if keep < 1:
            raise InputError(f"max_{part}_ckpt_to_keep: expected null or >= 1, found {keep}")
        kept = 0
        for s in steps:
            path = os.path.join(step_dir(root, s), part)
            if not os.path.isdir(path):
                continue
            if kept < keep:
                kept += s in complete
                continue
            if step_dir(root, s) in protected:
                continue
            shutil.rmtree(path)
            removed.append(path)
    for s in steps:
        path = step_dir(root, s)
        ours = any(os.path.isfile(os.path.join(path, name)) for name in (STATE_FILE, MANIFEST_FILE))
        if ours and path not in protected and not any(os.path.isdir(os.path.join(path, part))
                                                      for part in ("actor", "critic")):
            shutil.rmtree(path)
            removed = [p for p in removed if not p.startswith(path + os.sep)] + [path]
    if removed:
        logger.info("checkpoints: removed %s", ", ".join(removed))
    return removed


def write_manifest(path: str) -> None:
    """Every file of the checkpoint directory ``path`` with its size, and a CRC32 of each file of at most
    :data:`CHECKSUM_MAX_BYTES`, written last (atomically); every file and directory is fsynced first."""
    files, crcs = {}, {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if rel in (MANIFEST_FILE, MANIFEST_FILE + ".tmp"):
                continue
            files[rel] = os.path.getsize(full)
            if files[rel] <= CHECKSUM_MAX_BYTES:
                crcs[rel] = _crc32(full)
    fsync_tree(path)
    tmp = os.path.join(path, MANIFEST_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"files": dict(sorted(files.items())), "crc32": dict(sorted(crcs.items()))}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST_FILE))
    fsync_path(path)


def checkpoint_problem(path: str) -> str | None:
    """None when the checkpoint directory ``path`` is complete, else what is wrong with it (one line
    naming the file). Checkpoints written before manifests existed are checked for their state file."""
    state_file = os.path.join(path, STATE_FILE)
    manifest_file = os.path.join(path, MANIFEST_FILE)
    if not os.path.isdir(path):
        return f"expected a checkpoint directory, found nothing at {path}"
    if os.path.isfile(manifest_file):
        try:
            with open(manifest_file, encoding="utf-8") as fh:
                manifest = json.load(fh)
            files, crcs = manifest["files"], manifest.get("crc32", {})  # no crc32: written before checksums
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"{manifest_file}: expected the JSON file list, found an unreadable file ({type(err).__name__})"
        for name, size in files.items():
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                return f"{full}: expected a file of {size} bytes, found it missing"
            if os.path.getsize(full) != size:
                return f"{full}: expected {size} bytes, found {os.path.getsize(full)} (cut or overwritten)"
            if name in crcs and _crc32(full) != crcs[name]:
                return f"{full}: expected CRC32 {crcs[name]}, found {_crc32(full)} (corrupt)"
    if not os.path.isfile(state_file):
        return f"{state_file}: expected the trainer state, found it missing"
    try:
        with open(state_file, encoding="utf-8") as fh:
            state = json.load(fh)
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{state_file}: expected JSON with the step, found an unreadable file ({type(err).__name__})"
    return None


def _complete_checkpoints(root: str) -> list[str]:
    """``global_step_<N>`` directories under ``root`` that pass :func:`checkpoint_problem`, newest first."""
    steps = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        prefix, _, number = name.rpartition("_")
        if prefix == "global_step" and number.isdigit():
            steps.append(int(number))
    return [step_dir(root, s) for s in sorted(steps, reverse=True) if checkpoint_problem(step_dir(root, s)) is None]


def find_resume_dir(root: str, resume_mode: str, resume_from_path: str | None = None) -> str | None:
    """``auto``: the latest complete checkpoint under ``root`` (None if there is none): when the one
    ``latest_checkpointed_iteration.txt`` names is cut or garbled, a warning names the bad file and
    the newest complete one is used. ``disable``: None. ``resume_path``: ``resume_from_path`` (verl's
    keys); any other value: that checkpoint directory. An explicit checkpoint must be complete."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        latest = os.path.join(root, LATEST_FILE)
        if not os.path.isfile(latest) and not _complete_checkpoints(root):
            return None
        problem = None
        try:
            with open(latest, encoding="utf-8") as fh:
                path = step_dir(root, int(fh.read().strip()))
            problem = checkpoint_problem(path)
        except (OSError, ValueError) as err:
            problem = f"{latest}: expected a step number, found an unreadable file ({type(err).__name__})"
        if problem is None:
            return path
        fallback = _complete_checkpoints(root)
        logger.warning("resume: the latest checkpoint is incomplete: %s; %s", problem,
                       f"resuming from {fallback[0]} instead" if fallback else "no complete checkpoint: starting over")
        return fallback[0] if fallback else None
    path = os.path.abspath(resume_from_path if resume_mode == "resume_path" else resume_mode)
    problem = checkpoint_problem(path)
    if problem is not None:
        key = "trainer.resume_from_path" if resume_mode == "resume_path" else "trainer.resume_mode"
        raise CheckpointError(f"{key}: {problem}")
    return path


def load_trainer_state(path: str) -> dict[str, Any]:
    """The trainer state of checkpoint ``path``, and this rank's RNG restored."""
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as fh:
        state = json.load(fh)
    rng_dir = os.path.join(path, "rng")
    saved_world = len([f for f in os.listdir(rng_dir) if f.startswith("rank") and f.endswith(".pt")])
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if saved_world != world:
        # Resumed at another world size (e.g. 2 nodes -> 1): the engines reshard their state, but per-rank RNG
        # streams have no counterpart, so every rank keeps the streams it was seeded with (seed + rank).
        logger.warning("checkpoint %s: written by %d ranks, resumed by %d: the model and optimizer state reshard; "
                       "each rank's random streams start from its seed", path, saved_world, world)
        state["_rng"] = rng_state()
        return state
    rng_file = os.path.join(rng_dir, f"rank{_rank()}.pt")
    if not os.path.isfile(rng_file):
        raise CheckpointError(f"checkpoint {path}: expected {rng_file} (saved with the same world size), found none")
    state["_rng"] = torch.load(rng_file, map_location="cpu", weights_only=True)
    return state
