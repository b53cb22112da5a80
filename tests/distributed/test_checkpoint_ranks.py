"""Checkpoints written by two ranks (issue 56, item 5): each rank checksums and fsyncs the files it wrote before the
barrier after which rank 0 publishes them (on Lustre/GPFS another client's fsync does not flush this node's
pages); a load splits the CRC32 checks over the ranks, and one flipped bit in any rank's file is the same
CheckpointError on both; a full disk on one rank -- simulated, or real inside DCP's and Megatron's save -- is the
same DiskFullError on both, and another error on one rank ends both instead of leaving one in a collective.

One spawn of two gloo ranks runs every scenario (:func:`_scenarios`); the tests below read its results."""

import importlib.util
import json
import os
import subprocess
import zlib

import pytest

from verl.launcher.spawn import run_ranks_with_rank

STEP1 = "global_step_1"


def _scenarios(rank, world, root, small_fs):
    import errno
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from verl.utils import checkpoint as ckpt

    run = os.path.join(root, "run")
    events = {"fsync": [], "sealed": [], "read": [], "publish": None}
    real_fsync, real_crc, real_replace = os.fsync, ckpt.file_crc32, os.replace

    def relative(path):
        rel = os.path.relpath(path, run)
        for staging, final in ((STEP1 + ".tmp", STEP1), ("actor.tmp", "actor")):
            rel = rel.replace(staging, final)
        return rel.removeprefix(STEP1 + os.sep)

    def fsync(fd):
        events["fsync"].append((time.monotonic(), relative(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def file_crc32(path, fsync=False):
        events["sealed" if fsync else "read"].append(relative(path))
        return real_crc(path, fsync)

    def replace(src, dst, **kwargs):
        if os.fspath(dst) == os.path.join(run, STEP1):
            events["publish"] = time.monotonic()
        real_replace(src, dst, **kwargs)

    os.fsync, os.replace = fsync, replace
    ckpt.file_crc32 = file_crc32
    out = {}

    def dcp_writer(tensor):
        return lambda staging: dcp.save({f"w{rank}": tensor}, checkpoint_id=staging)

    def files_manifest(files):
        return {"files": files}

    def save_models(staging):
        ckpt.save_engine_checkpoint(os.path.join(staging, "actor"), dcp_writer(torch.full((1000,), float(rank))),
                                    files_manifest)
        os.makedirs(os.path.join(staging, "replay_buffer"), exist_ok=True)
        torch.save({"tokens": torch.arange(1000) + rank},
                   os.path.join(staging, "replay_buffer", f"shard{rank}-of-{world}.pt"))

    final = ckpt.save_trainer_checkpoint(run, 1, {}, save_models)
    out["fsync"], out["sealed"], out["publish"] = list(events["fsync"]), list(events["sealed"]), events["publish"]

    events["read"].clear()
    ckpt.load_trainer_state(final)
    ckpt.read_engine_manifest(os.path.join(final, "actor"))
    out["read"] = list(events["read"])

    def flip(name):
        dist.barrier()
        if rank == 0:
            with open(os.path.join(final, name), "r+b") as fh:
                data = bytearray(fh.read())
                data[len(data) // 2] ^= 0x10
                fh.seek(0)
                fh.write(data)
        dist.barrier()

    def flip_then_load(name, load):
        flip(name)
        try:
            load()
        except ckpt.CheckpointError as err:
            return str(err)
        finally:
            flip(name)  # back as written
        return None

    out["flipped shard"] = flip_then_load(os.path.join("replay_buffer", "shard1-of-2.pt"),
                                          lambda: ckpt.load_trainer_state(final))
    out["flipped engine"] = flip_then_load(os.path.join("actor", "__1_0.distcp"),
                                           lambda: ckpt.read_engine_manifest(os.path.join(final, "actor")))

    def full_on_rank_1(staging):  # as torch.save raises it: a RuntimeError with the OSError as its cause
        if rank == 1:
            raise RuntimeError("[enforce fail] unexpected pos") from OSError(
                errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(staging, "rng", "rank1.pt"))

    def bug_on_rank_1(staging):
        if rank == 1:
            raise ValueError("a bug on rank 1")

    for key, step, save in (("full", 2, full_on_rank_1), ("bug", 3, bug_on_rank_1)):
        try:
            ckpt.save_trainer_checkpoint(run, step, {}, save)
        except Exception as err:  # noqa: BLE001 - the error each rank ends with is the result
            out[key] = f"{type(err).__name__}: {err}"
        dist.barrier()
    out["run after"] = sorted(os.listdir(run))

    big = torch.ones(100_000)  # 400 KB per rank: the two do not fit in 600 KB
    try:
        ckpt.save_engine_checkpoint(os.path.join(small_fs, "dcp"), dcp_writer(big), files_manifest)
    except ckpt.DiskFullError as err:
        out["dcp full"] = str(err)
    dist.barrier()
    out["fs after dcp"] = sorted(os.listdir(small_fs))

    if importlib.util.find_spec("megatron.core") is not None:
        from verl.engine.megatron.cpu_patches import apply_cpu_patches

        apply_cpu_patches()
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        state = {"w": ShardedTensor.from_rank_offsets("w", big, (0, rank, world))}
        try:
            ckpt.save_engine_checkpoint(os.path.join(small_fs, "megatron"),
                                        lambda staging: dist_checkpointing.save(state, staging), files_manifest)
        except ckpt.DiskFullError as err:
            out["megatron full"] = str(err)
        dist.barrier()
        out["fs after megatron"] = sorted(os.listdir(small_fs))
    return json.dumps(out)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    small_fs = root / "fs"
    small_fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(small_fs)], check=True, timeout=30)
    try:
        results = run_ranks_with_rank(_scenarios, 2, str(root), str(small_fs), timeout_s=240)
    finally:
        subprocess.run(["umount", "-l", str(small_fs)], check=False, timeout=30)
    return root, [json.loads(r) for r in results]


OWN = {0: {os.path.join("rng", "rank0.pt"), os.path.join("replay_buffer", "shard0-of-2.pt"), "trainer_state.json",
           os.path.join("actor", "__0_0.distcp"), os.path.join("actor", ".metadata")},
       1: {os.path.join("rng", "rank1.pt"), os.path.join("replay_buffer", "shard1-of-2.pt"),
           os.path.join("actor", "__1_0.distcp")}}
FLIPPED = {os.path.join("replay_buffer", "shard1-of-2.pt"), os.path.join("actor", "__1_0.distcp")}  # afterwards


def test_each_rank_checksums_and_fsyncs_its_own_files_before_rank_0_publishes(ranks):
    root, results = ranks
    assert set(results[1]["sealed"]) == OWN[1], results[1]["sealed"]
    assert set(results[0]["sealed"]) >= OWN[0] and not set(results[0]["sealed"]) & OWN[1], results[0]["sealed"]
    publish = results[0]["publish"]
    for rank in (0, 1):
        synced = {name: at for at, name in results[rank]["fsync"]}
        assert OWN[rank] <= set(synced), (rank, sorted(synced))
        assert all(synced[name] < publish for name in OWN[rank])  # CLOCK_MONOTONIC: one clock for the host
    final = root / "run" / STEP1
    manifest = json.loads((final / "verl_trainer_manifest.json").read_text())
    assert set(manifest["crc32"]) == set(manifest["files"]) >= OWN[0] | OWN[1]
    for name in manifest["crc32"]:
        assert manifest["crc32"][name] == f"{zlib.crc32((final / name).read_bytes()):08x}", name


def test_a_load_splits_the_crc32_checks_over_the_ranks(ranks):
    root, results = ranks
    read = [results[rank]["read"] for rank in (0, 1)]
    both = read[0] + read[1]
    assert read[0] and read[1] and len(both) == len(set(both)), read  # each file read once, by one rank
    manifest = json.loads((root / "run" / STEP1 / "verl_trainer_manifest.json").read_text())
    assert set(both) == set(manifest["files"])  # the engine's files by its own check, the others by the trainer's


@pytest.mark.parametrize("key, name", [("flipped shard", "shard1-of-2.pt"), ("flipped engine", "__1_0.distcp")])
def test_a_flipped_bit_in_another_ranks_file_is_the_same_error_on_every_rank(ranks, key, name):
    _, results = ranks
    message = results[0][key]
    assert message is not None and message == results[1][key], (results[0][key], results[1][key])
    assert "\n" not in message and name in message and "expected CRC32" in message, message


def test_a_full_disk_on_one_rank_is_the_same_disk_full_error_on_every_rank(ranks):
    _, results = ranks
    assert results[0]["full"] == results[1]["full"], (results[0]["full"], results[1]["full"])
    message = results[0]["full"]
    assert message.startswith("DiskFullError: checkpoint of step 2 not saved: rank 1: No space left on device")
    assert message.endswith(f"the last complete checkpoint is {os.path.join(ranks[0], 'run', STEP1)}"), message
    assert "global_step_2.tmp" not in results[0]["run after"]


def test_another_error_on_one_rank_ends_every_rank(ranks):
    _, results = ranks
    assert results[1]["bug"] == "ValueError: a bug on rank 1"
    assert results[0]["bug"].startswith("RuntimeError: checkpoint ") and \
        results[0]["bug"].endswith("global_step_3 not saved: rank 1 failed: ValueError: a bug on rank 1")


@pytest.mark.parametrize("writer", ["dcp", "megatron"])
def test_a_full_disk_inside_dcp_or_megatron_is_the_same_disk_full_error_on_every_rank(ranks, writer):
    if writer == "megatron":
        pytest.importorskip("megatron.core")
    _, results = ranks
    message = results[0].get(f"{writer} full")
    assert message is not None and message == results[1].get(f"{writer} full"), (message, results[1])
    assert "No space left on device" in message and "nothing of it was kept" in message, message
    assert results[0][f"fs after {writer}"] == [], results[0][f"fs after {writer}"]
