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
so a run killed at any instant leaves either the previous or the new checkpoint, never a torn one. A directory
without its manifest is incomplete, and auto-resume takes the newest complete step, whatever ``latest`` names
(a save that died between its rename and the ``latest`` update left a newer complete one).
Staging directories a killed run left behind are removed at the next save; one whose saver is alive is not: the
saver holds a lock on ``global_step_<N>.tmp.lock`` (:func:`clean_stale_staging`).

Durable and checked: after writing, every rank reads back the files it wrote (:func:`_writer_rank`) with a
streaming CRC32 and fsyncs them before the barrier (on Lustre/GPFS another client's fsync does not flush this
node's pages); rank 0 records every file's size and CRC32 in the manifest, fsyncs the directories, then
renames. Whenever a checkpoint is judged complete (resume, pruning) the sizes and the small files' CRC32 are
checked; loading it (:func:`load_trainer_state`, :func:`read_engine_manifest`) checks every file's CRC32,
the files split over the ranks, so one flipped bit anywhere is one :class:`CheckpointError` naming the file.

Disk space: a save needs room for one more checkpoint beside the kept ones (the old ones are pruned only once
the new one is complete). Before writing, rank 0 compares the free space with the newest complete checkpoint's
size; when it is short, older checkpoints beyond ``max_to_keep - 1`` are pruned first (never the newest complete
one), and if that is not enough the save is refused up front. A file system that fills up during the save anyway
(``ENOSPC``/``EDQUOT`` on any rank, raised by our writes or inside torch.save, DCP or Megatron's save:
:func:`disk_full_reason`) ends in the same :class:`DiskFullError` on every rank: one line naming the last
complete checkpoint, with the staging directory removed.
The engines' parts (``actor/``, ``critic/``) are staged, checksummed and renamed the same way by
:func:`save_engine_checkpoint`, with their own manifest ``verl_checkpoint.json``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import re
import shutil
import socket
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
MANIFEST_FILE = "verl_trainer_manifest.json"  # every file with its size and CRC32, written last
# Every file's CRC32 is checked when a checkpoint is loaded; the cheaper completeness check (resume target,
# pruning, preflight: every checkpoint of a run, at every save) checks the sizes and the CRC32 of the files up
# to this size only: the trainer state, every rank's RNG, the engines' manifests and Megatron's metadata -- the
# files that decide what a resume does, a few KB each -- not the model and optimizer shards (tens of GB).
CHECKSUM_MAX_BYTES = 1 << 20
# zlib.crc32 (no crc32c or xxhash in the environment): measured on one core of a shared 2-core machine, 6.2 GiB/s in
# memory and 5.1 GiB/s reading a file from the page cache in 1 MiB readinto chunks: ~2 s per 10 GB a rank wrote.
CHECKSUM_CHUNK = 1 << 20
ENGINE_MANIFEST = "verl_checkpoint.json"  # an engine checkpoint's (actor/, critic/) file list and layout
STAGING_LOCK = ".lock"  # beside a staging directory: global_step_<N>.tmp.lock, held by its live saver
# Files named by the rank that writes them: DCP's and Megatron's shards (__<rank>_<i>.distcp), each rank's RNG
# and replay-buffer shard. The others (metadata, manifests, the trainer state) are written by rank 0.
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank(\d+)\.pt|shard(\d+)-of-\d+\.pt)$")


class CheckpointError(InputError):
    """A checkpoint (trainer resume target, Megatron checkpoint or HF model directory) that is missing,
    incomplete, corrupt, or for another model: the one error class for every checkpoint reader."""


class DiskFullError(RuntimeError):
    """The file system ran out of space or quota while a checkpoint was written: neither bad input nor a bug.
    Its message is one line naming the last complete checkpoint; nothing of the failed save is left."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SPACE_HEADROOM = 1.05  # a checkpoint's size varies a little from step to step (JSON state, manifests)
SPACE_PROBE_BYTES = 1 << 16


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(value: Any) -> list[Any]:
    """Collective: every rank's ``value`` (JSON-like), in rank order; this process's alone without a group."""
    if _world() == 1:
        return [value]
    values = [None] * _world()
    dist.all_gather_object(values, value)
    return values


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


def fsync_tree(path: str, files: bool = True) -> None:
    """fsync every file (unless ``files`` is False: their writers did) and directory under ``path`` (each
    directory after its contents). Before the rename that publishes a checkpoint: without it a crash of the node
    soon after could leave a published (and ``latest``) checkpoint whose files were never written out -- sizes
    right, contents zeros."""
    for root, _, names in os.walk(path, topdown=False):
        for name in names if files else ():
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def file_crc32(path: str, fsync: bool = False) -> tuple[int, str]:
    """(size, CRC32 as 8 hex digits) of file ``path``, read in :data:`CHECKSUM_CHUNK` pieces; ``fsync``: then
    flushed to stable storage too (by the node that wrote it: its pages are the ones to flush)."""
    crc, size = 0, 0
    buffer = bytearray(CHECKSUM_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while count := fh.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
            size += count
        if fsync:
            os.fsync(fh.fileno())
    return size, f"{crc:08x}"


def _files(path: str) -> list[str]:
    """Every file under directory ``path``, relative, sorted."""
    return sorted(os.path.relpath(os.path.join(root, name), path) for root, _, names in os.walk(path)
                  for name in names)


def _writer_rank(name: str, world: int) -> int:
    """The rank that wrote checkpoint file ``name`` (relative): the one its name carries (:data:`_RANK_FILE`),
    else rank 0 (also for a rank number beyond ``world``)."""
    match = _RANK_FILE.match(os.path.basename(name))
    rank = int(next(group for group in match.groups() if group is not None)) if match else 0
    return rank if rank < world else 0


def _engine_dirs(path: str) -> list[str]:
    """The engine checkpoints inside checkpoint directory ``path`` (relative): they carry their own checksums."""
    return sorted(os.path.relpath(root, path) for root, _, names in os.walk(path)
                  if ENGINE_MANIFEST in names and root != path)


def _in_engine(name: str, engines: list[str]) -> bool:
    """Whether file ``name`` is one an engine checkpoint of ``engines`` lists (all its files but its manifest)."""
    return os.path.basename(name) != ENGINE_MANIFEST and any(name.startswith(d + os.sep) for d in engines)


def _seal_own_files(path: str, engines: list[str] = ()) -> dict[str, list]:
    """{name: [size, CRC32]} of the files under ``path`` that this rank wrote (but the ``engines``' files), each
    read back and fsynced: before the barrier after which rank 0 publishes them, since on Lustre/GPFS only the
    writing node's fsync flushes its pages."""
    rank, world = _rank(), _world()
    return {name: list(file_crc32(os.path.join(path, name), fsync=True)) for name in _files(path)
            if _writer_rank(name, world) == rank and not _in_engine(name, engines)}


def _merged(parts: list[dict[str, list]]) -> dict[str, list]:
    return {name: sums for part in parts for name, sums in part.items()}


def _one_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {text}"[:300]


def disk_full_reason(err: BaseException, where: str | None = None) -> str | None:
    """Why ``err``, raised while writing a checkpoint into directory ``where``, is the file system refusing
    space (``ENOSPC``/``EDQUOT``); None when it is another error. Writers hide it differently: torch.save raises
    a RuntimeError whose context is the OSError, or, writing to a path, one without any errno ('unexpected pos');
    DCP raises a CheckpointException holding each failed rank's error; Megatron's writer processes send back
    'Worker failure: [Errno 28] ...'. So: an OSError anywhere in the chain, else the message, else a probe write
    into ``where`` that the file system refuses."""
    chain, todo = [], [err]
    while todo:
        error = todo.pop(0)
        if error is None or any(error is seen for seen in chain):
            continue
        chain.append(error)
        failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (error, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [error.__cause__, error.__context__]
    for error in chain:
        if isinstance(error, DiskFullError):  # an engine's own staged save, inside the trainer's
            return str(error)
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return f"{os.strerror(error.errno)} writing {error.filename or where or 'a file'}"
    for error in chain:
        for code in DISK_FULL_ERRNOS:
            if os.strerror(code) in str(error):
                return f"{os.strerror(code)} writing {where or 'a file'} ({type(error).__name__})"
    code = _refused_space(where) if where else None
    return None if code is None else f"{os.strerror(code)} writing {where} (after {_one_line(err)})"


def _refused_space(directory: str) -> int | None:
    """``ENOSPC``/``EDQUOT`` when the file system of ``directory`` refuses :data:`SPACE_PROBE_BYTES` more
    (written, fsynced and removed), else None."""
    probe = os.path.join(directory, f".space_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(probe, "wb") as fh:
            fh.write(bytes(SPACE_PROBE_BYTES))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:
        return err.errno if err.errno in DISK_FULL_ERRNOS else None
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    return None


def _attempt(fn: Callable[[], Any], where: str) -> tuple[Any, BaseException | str | None]:
    """(``fn()``, None), or (None, what its failure tells the other ranks: the reason when the disk is full
    (:func:`disk_full_reason`), else the error itself)."""
    try:
        return fn(), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        reason = disk_full_reason(err, where)
        return None, err if reason is None else reason


# ----------------------------------------------------------------------------- staging locks
def _try_flock(fd: int) -> bool | None:
    """Whether an exclusive flock on ``fd`` was taken (False: another open file holds it); None where the file
    system has no flock (Lustre mounted without it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise
    return True


# The staging locks this process holds. A process forked during a save (a checkpoint writer's worker) shares the
# lock's open file, so its flock would outlive a killed rank for as long as that child runs, and the requeued job's
# save of the same step would find "a save running". Forked children drop their copies at once.
_HELD_LOCKS: set[int] = set()


def _drop_inherited_locks() -> None:
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _lock_staging(staging: str) -> int:
    """Rank 0 of a save: hold ``<staging>.lock`` until the save ends (:func:`_unlock_staging`), so that another
    run's :func:`clean_stale_staging` leaves the staging directory alone; taken before the directory exists.
    Its flock is the lock; this host and pid are written in it for a file system without flock."""
    fd = os.open(staging + STAGING_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if _try_flock(fd) is False:
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip()
            raise CheckpointError(f"{staging}: expected no other save of this step, found one running ({owner})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    _HELD_LOCKS.add(fd)
    return fd


def _unlock_staging(staging: str, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(staging + STAGING_LOCK)
    _HELD_LOCKS.discard(fd)
    os.close(fd)  # releases the flock


def _staging_alive(staging: str) -> bool:
    """Whether a live process is saving into ``staging``: it holds the flock of ``<staging>.lock``; where there
    is no flock, its pid runs on this host (another host's cannot be checked: taken as alive)."""
    try:
        fd = os.open(staging + STAGING_LOCK, os.O_RDWR)
    except FileNotFoundError:  # left by a save that predates the locks
        return False
    try:
        taken = _try_flock(fd)
        if taken is not None:
            return not taken
        host, _, pid = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
        if host != socket.gethostname():
            return True
        return pid.isdigit() and int(pid) != os.getpid() and pid_running(int(pid))
    finally:
        os.close(fd)  # and the flock taken above: the directory is removed next


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# ----------------------------------------------------------------------------- saving
def save_trainer_checkpoint(root: str, step: int, trainer_state: dict[str, Any],
                            save_models: Callable[[str], None],
                            max_to_keep: dict[str, int | None] | None = None) -> str:
    """Collective: ``save_models(staging_dir)`` writes the workers' parts; returns the final directory.
    ``max_to_keep`` (the trainer's ``max_*_ckpt_to_keep``) lets a save that lacks room prune first."""
    final = step_dir(root, step)
    staging = final + ".tmp"
    lock = None

    def prepare() -> str | None:
        nonlocal lock
        if _rank() != 0:
            return None
        os.makedirs(root, exist_ok=True)
        clean_stale_staging(root)
        problem = _make_room(root, step, max_to_keep or {})
        if problem is None:
            lock = _lock_staging(staging)
            os.makedirs(os.path.join(staging, "rng"))
        return problem

    def write_parts() -> None:
        save_models(staging)
        torch.save(rng_state(), os.path.join(staging, "rng", f"rank{_rank()}.pt"))
        if _rank() == 0:
            with open(os.path.join(staging, STATE_FILE), "w", encoding="utf-8") as fh:
                json.dump({"step": step, **trainer_state}, fh, indent=2)

    def publish(parts: list[dict[str, list]], engines: list[str]) -> None:
        if _rank() != 0:
            return
        # last: a checkpoint without it (or not matching it) is incomplete
        write_manifest(staging, _merged(parts) | _engine_sums(staging, engines))
        _replace_dir(staging, final)
        fsync_path(root)  # the rename is durable before `latest` names it
        latest = os.path.join(root, LATEST_FILE)
        with open(latest + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(f"{step}\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(latest + ".tmp", latest)
        fsync_path(root)

    problem, outcome = _attempt(prepare, root)
    try:
        # Only a staging directory this save locked is removed on failure: another one is a live saver's.
        _agree(outcome or problem, root, step, staging, remove_staging=lock is not None)
        _agree(_attempt(write_parts, staging)[1], root, step, staging)
        engines = _engine_dirs(staging)  # sealed (checksummed, fsynced) by their own staged saves
        sealed, outcome = _attempt(lambda: _seal_own_files(staging, engines), staging)
        parts = _agree(outcome, root, step, staging, payload=sealed)
        _, outcome = _attempt(lambda: publish(parts, engines), root)
        if outcome is not None and _rank() == 0 and os.path.isdir(final) and checkpoint_problem(final) is not None:
            shutil.rmtree(final, ignore_errors=True)  # renamed but its `latest` pointer failed: not kept
        _agree(outcome, root, step, staging)
    finally:
        if lock is not None:
            _unlock_staging(staging, lock)
    return final


def _engine_sums(path: str, engines: list[str]) -> dict[str, list]:
    """{name: [size, CRC32]} of the engine checkpoints' files, from their manifests."""
    sums = {}
    for engine in engines:
        with open(os.path.join(path, engine, ENGINE_MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
        sums.update({os.path.join(engine, name): [manifest["sizes"][name], crc]
                     for name, crc in manifest.get("crc32", {}).items()})
    return sums


def clean_stale_staging(root: str) -> list[str]:
    """Remove the ``global_step_<N>.tmp`` directories (with their locks) and ``latest``'s temp file that killed
    saves left under ``root`` (rank 0, before a save). A staging directory whose saver is alive (another run
    saving into the same directory: :func:`_staging_alive`) is left alone, and ``latest``'s temp file with it.
    Returns what was removed."""
    names = os.listdir(root) if os.path.isdir(root) else []
    stagings = sorted({name.removesuffix(STAGING_LOCK) for name in names if name.startswith("global_step_")
                       and name.removesuffix(STAGING_LOCK).endswith(".tmp")})
    removed, live = [], []
    for name in stagings:
        path = os.path.join(root, name)
        if _staging_alive(path):
            live.append(path)
            continue
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + STAGING_LOCK)
    if LATEST_FILE + ".tmp" in names and not live:
        os.remove(os.path.join(root, LATEST_FILE + ".tmp"))
        removed.append(os.path.join(root, LATEST_FILE + ".tmp"))
    if removed:
        logger.warning("checkpoints: removed staging left by an interrupted save: %s", ", ".join(removed))
    if live:
        logger.warning("checkpoints: left %s alone: a live process is saving into it (another run with this "
                       "trainer.default_local_dir?)", ", ".join(live))
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



def _agree(outcome: BaseException | str | None, root: str, step: int | None, staging: str,
           payload: Any = None, remove_staging: bool = True) -> list[Any]:
    """Collective: every rank learns how every rank's part of the save went (``outcome``: None, the reason the
    disk is full, or an error) and gets every rank's ``payload``, returned in rank order when all went well.
    Any rank out of space: every rank raises the same :class:`DiskFullError` (rank 0 first removes the staging
    directory). Else any rank failed: it raises its error and the others a RuntimeError naming it, rather than
    waiting for it in the next collective."""
    report = None
    if outcome is not None:
        report = ("disk", outcome) if isinstance(outcome, str) else ("error", _one_line(outcome))
    everyone = _gather([report, payload])
    failed = [(rank, report) for rank, (report, _) in enumerate(everyone) if report is not None]
    if not failed:
        return [payload for _, payload in everyone]
    name = staging.removesuffix(".tmp")
    full = [(rank, why) for rank, (kind, why) in failed if kind == "disk"]
    if full:
        if _rank() == 0 and remove_staging:
            shutil.rmtree(staging, ignore_errors=True)
        rank, why = full[0]
        if step is None:  # an engine's part (actor/, critic/ or a standalone `verl convert` output)
            raise DiskFullError(f"checkpoint {name} not saved: rank {rank}: {why}; nothing of it was kept")
        last = _complete_checkpoints(root)
        raise DiskFullError(f"checkpoint of step {step} not saved: rank {rank}: {why}; nothing of it was kept; "
                            f"the last complete checkpoint is {last[0] if last else 'none'}")
    if isinstance(outcome, BaseException):
        raise outcome
    rank, (_, why) = failed[0]
    raise RuntimeError(f"checkpoint {name} not saved: rank {rank} failed: {why}")


def _replace_dir(staging: str, final: str) -> None:
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(staging, final)


def save_engine_checkpoint(path: str, write: Callable[[str], None],
                           manifest: Callable[[list[str]], dict[str, Any]]) -> None:
    """An engine's (Megatron, FSDP) checkpoint, atomically. Collective over every rank of the job: each rank's
    ``write(staging)`` fills ``<path>.tmp`` and each rank checksums and fsyncs the files it wrote; rank 0 then
    stores ``manifest(files)`` (every file written, relative and sorted) with every file's size and CRC32 as
    :data:`ENGINE_MANIFEST` and renames the directory to ``path``, replacing an older one, so a crash never
    leaves a half-written ``path``. A full disk on any rank is the same :class:`DiskFullError` on every rank."""
    path = os.path.abspath(path)
    staging = path + ".tmp"
    parent = os.path.dirname(path)

    def prepare() -> None:
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)

    def publish(sealed: list[dict[str, list]]) -> None:
        if _rank() != 0:
            return
        files = _files(staging)
        sums = _merged(sealed)
        for name in set(files) - set(sums):  # a file whose name does not tell its writer: rank 0's
            sums[name] = list(file_crc32(os.path.join(staging, name), fsync=True))
        record = {**manifest(files), "sizes": {n: sums[n][0] for n in files}, "crc32": {n: sums[n][1] for n in files}}
        with open(os.path.join(staging, ENGINE_MANIFEST), "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_tree(staging, files=False)  # the files were fsynced by their writers
        _replace_dir(staging, path)
        fsync_path(parent)

    _agree(_attempt(prepare, parent)[1], parent, None, staging)
    _agree(_attempt(lambda: write(staging), staging)[1], parent, None, staging)
    sealed, outcome = _attempt(lambda: _seal_own_files(staging), staging)
    parts = _agree(outcome, parent, None, staging, payload=sealed)
    _agree(_attempt(lambda: publish(parts), staging)[1], parent, None, staging)


def read_engine_manifest(path: str) -> dict:
    """The engine checkpoint's manifest, after checking every file it lists is present with its size and its
    CRC32 (:func:`verify_files`: collective, as the engines' loads are)."""
    file = os.path.join(path, ENGINE_MANIFEST)
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path}: expected {ENGINE_MANIFEST}, found it missing")
    with open(file, encoding="utf-8") as fh:
        manifest = json.load(fh)
    sizes = manifest.get("sizes", {})  # none in a manifest written before checksums: presence only
    for name in manifest["files"]:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path}: expected file {name}, found it missing")
        if name in sizes and os.path.getsize(full) != sizes[name]:
            raise CheckpointError(f"checkpoint {path}: expected file {name} of {sizes[name]} bytes, found "
                                  f"{os.path.getsize(full)} (cut or overwritten)")
    verify_files(path, manifest.get("crc32", {}), sizes)
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


def write_manifest(path: str, sealed: dict[str, list] | None = None) -> None:
    """The manifest of checkpoint directory ``path``, written last (atomically): every file with its size and
    CRC32. ``sealed``: {name: [size, CRC32]} of files that the ranks that wrote them already checksummed and
    fsynced; the others are read and fsynced here. Every directory is fsynced before the manifest."""
    sizes, crcs = {}, {}
    for name in _files(path):
        if name in (MANIFEST_FILE, MANIFEST_FILE + ".tmp"):
            continue
        sizes[name], crcs[name] = (sealed or {}).get(name) or file_crc32(os.path.join(path, name), fsync=True)
    fsync_tree(path, files=False)
    tmp = os.path.join(path, MANIFEST_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"files": sizes, "crc32": crcs}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST_FILE))
    fsync_path(path)


def checkpoint_problem(path: str) -> str | None:
    """None when the checkpoint directory ``path`` is complete, else what is wrong with it (one line naming
    the file): its manifest (written last) present, every file it lists of its size, the small files
    (:data:`CHECKSUM_MAX_BYTES`) of their CRC32, and the trainer state readable. The large files' CRC32 is
    checked when the checkpoint is loaded (:func:`verify_checkpoint`)."""
    state_file = os.path.join(path, STATE_FILE)
    manifest_file = os.path.join(path, MANIFEST_FILE)
    if not os.path.isdir(path):
        return f"expected a checkpoint directory, found nothing at {path}"
    if not os.path.isfile(manifest_file):
        return f"{manifest_file}: expected the manifest a save writes last, found none (the save did not finish)"
    manifest = _read_json(manifest_file, lambda m: m["files"].items())
    if isinstance(manifest, str):
        return f"{manifest_file}: expected the JSON file list, found {manifest}"
    files, crcs = manifest["files"], manifest.get("crc32", {})  # no crc32: written before checksums
    for name, size in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{full}: expected a file of {size} bytes, found it missing"
        if os.path.getsize(full) != size:
            return f"{full}: expected {size} bytes, found {os.path.getsize(full)} (cut or overwritten)"
        if name in crcs and size <= CHECKSUM_MAX_BYTES and (found := file_crc32(full)[1]) != crcs[name]:
            return f"{full}: expected CRC32 {crcs[name]}, found {found} (corrupt)"
    if not os.path.isfile(state_file):
        return f"{state_file}: expected the trainer state, found it missing"
    state = _read_json(state_file, lambda m: int(m["step"]))
    if isinstance(state, str):
        return f"{state_file}: expected JSON with the step, found {state}"
    return None


def _read_json(file: str, check: Callable[[dict], object]) -> dict | str:
    """The JSON object in ``file`` when ``check`` can read what it needs from it, else what was found instead."""
    try:
        with open(file, encoding="utf-8") as fh:
            value = json.load(fh)
        check(value)
        return value
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"an unreadable file ({type(err).__name__})"


def _complete_checkpoints(root: str) -> list[str]:
    """``global_step_<N>`` directories under ``root`` that pass :func:`checkpoint_problem`, newest first."""
    steps = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        prefix, _, number = name.rpartition("_")
        if prefix == "global_step" and number.isdigit():
            steps.append(int(number))
    return [step_dir(root, s) for s in sorted(steps, reverse=True) if checkpoint_problem(step_dir(root, s)) is None]


def find_resume_dir(root: str, resume_mode: str, resume_from_path: str | None = None) -> str | None:
    """``auto``: the newest complete checkpoint under ``root`` (None if there is none). When
    ``latest_checkpointed_iteration.txt`` names another one -- cut or garbled, or an older one (a save that died
    between its rename and the ``latest`` update) -- a warning names it and the newest complete one is used.
    ``disable``: None. ``resume_path``: ``resume_from_path`` (verl's keys); any other value: that checkpoint
    directory. An explicit checkpoint must be complete."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        latest = os.path.join(root, LATEST_FILE)
        complete = _complete_checkpoints(root)
        if not os.path.isfile(latest) and not complete:
            return None
        newest = complete[0] if complete else None
        try:
            with open(latest, encoding="utf-8") as fh:
                path = step_dir(root, int(fh.read().strip()))
            problem = checkpoint_problem(path)
        except (OSError, ValueError) as err:
            problem = f"{latest}: expected a step number, found an unreadable file ({type(err).__name__})"
        if problem is None and path == newest:
            return path
        if problem is None:
            logger.warning("resume: %s names %s, but %s is newer and complete (its save stopped before updating "
                           "the file): resuming from it", latest, path, newest)
        else:
            logger.warning("resume: the latest checkpoint is incomplete: %s; %s", problem,
                           f"resuming from {newest} instead" if newest else "no complete checkpoint: starting over")
        return newest
    path = os.path.abspath(resume_from_path if resume_mode == "resume_path" else resume_mode)
    problem = checkpoint_problem(path)
    if problem is not None:
        key = "trainer.resume_from_path" if resume_mode == "resume_path" else "trainer.resume_mode"
        raise CheckpointError(f"{key}: {problem}")
    return path


def verify_files(path: str, crcs: dict[str, str], sizes: dict[str, int]) -> None:
    """Every file of ``crcs`` ({name under ``path``: CRC32}) read and compared. Collective when a process group
    exists (every rank calls it): the files are split over the ranks by size, and a mismatch on any rank is the
    same :class:`CheckpointError` on every rank, naming the file, the CRC32 expected and the one found."""
    loads, mine = [0] * _world(), []
    for name in sorted(crcs, key=lambda n: (-sizes.get(n, 0), n)):  # largest first, each to the least loaded
        rank = loads.index(min(loads))
        loads[rank] += sizes.get(name, 0) + 1
        if rank == _rank():
            mine.append(name)
    problem = None
    for name in mine:
        full = os.path.join(path, name)
        try:
            found = file_crc32(full)[1]
        except OSError as err:
            problem = f"{full}: expected a readable file, found {err.strerror or type(err).__name__}"
            break
        if found != crcs[name]:
            problem = f"{full}: expected CRC32 {crcs[name]}, found {found} (changed after it was written)"
            break
    problems = [p for p in _gather(problem) if p is not None]
    if problems:
        raise CheckpointError(f"checkpoint {path}: {problems[0]}")


def verify_checkpoint(path: str) -> None:
    """Collective (:func:`verify_files`): every file of trainer checkpoint ``path`` matches its manifest's CRC32,
    but those of its engine checkpoints (``actor/``, ``critic/``), which their loads check
    (:func:`read_engine_manifest`), so no file is read twice."""
    with open(os.path.join(path, MANIFEST_FILE), encoding="utf-8") as fh:
        manifest = json.load(fh)
    engines = [os.path.dirname(name) for name in manifest["files"] if os.path.basename(name) == ENGINE_MANIFEST]
    engine_files = set(_engine_sums(path, engines))
    crcs = {name: crc for name, crc in manifest.get("crc32", {}).items() if name not in engine_files}
    verify_files(path, crcs, manifest["files"])


def load_trainer_state(path: str) -> dict[str, Any]:
    """The trainer state of checkpoint ``path``, and this rank's RNG restored. Collective: every file but the
    engines' is checked against its CRC32 first (:func:`verify_checkpoint`)."""
    verify_checkpoint(path)
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
