"""A checkpoint is on disk before it is published, and every file is checksummed: every file and directory is
fsynced before the staging directory is renamed (and before `latest` names it); a trainer state or RNG file
changed in place (same size) makes the checkpoint incomplete, naming the file; one flipped bit in a large file
(a replay-buffer shard) fails the resume with one line naming the file (exit 2)."""

import json
import os
import re
import zlib

import pytest

from verl.engine.rollout.partial import PromptGroup
from verl.errors import exit_code
from verl.trainer.v1.replay_buffer import PromptStream, ReplayBuffer
from verl.utils import checkpoint as ckpt
from verl.utils.dataset.rl_dataset import ResumableSampler

pytestmark = pytest.mark.unit


def writer(shard_bytes):
    def save_models(staging):
        os.makedirs(os.path.join(staging, "actor"))
        with open(os.path.join(staging, "actor", "__0_0.distcp"), "wb") as fh:
            fh.write(b"w" * shard_bytes)
    return save_models


def test_every_file_and_directory_is_fsynced_before_the_checkpoint_is_published(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst, **kwargs):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = str(tmp_path)
    final = ckpt.save_trainer_checkpoint(root, 3, {"sampler": [1, 2]}, writer(3000))
    staging = final + ".tmp"
    publish = next(i for i, e in enumerate(events) if e[:3] == ("replace", staging, final))
    synced_before = {e[1] for e in events[:publish] if e[0] == "fsync"}
    written = {os.path.join(dirpath, name) for dirpath, _, names in os.walk(final) for name in names}
    directories = {dirpath for dirpath, _, _ in os.walk(final)}
    expected = {p.replace(final, staging, 1) for p in written | directories}
    manifest = os.path.join(staging, ckpt.MANIFEST_FILE)
    expected = expected - {manifest} | {manifest + ".tmp"}  # fsynced under its temporary name, then renamed
    assert written and expected <= synced_before
    latest = os.path.join(root, ckpt.LATEST_FILE)
    named = next(i for i, e in enumerate(events) if e[:3] == ("replace", latest + ".tmp", latest))
    assert ("fsync", root) in events[publish:named]  # the rename is durable before `latest` names it
    assert ("fsync", latest + ".tmp") in events[publish:named] and ("fsync", root) in events[named:]


def _flip_middle_bit(data: bytes) -> bytes:
    data = bytearray(data)
    data[len(data) // 2] ^= 0x01
    return bytes(data)


@pytest.mark.parametrize("name, damage", [
    (ckpt.STATE_FILE, lambda data: data.replace(b'"epoch": 0', b'"epoch": 7')),  # still valid JSON
    (os.path.join("rng", "rank0.pt"), _flip_middle_bit),
])
def test_a_small_file_changed_in_place_makes_the_checkpoint_incomplete(tmp_path, name, damage):
    previous = ckpt.save_trainer_checkpoint(str(tmp_path), 1, {"epoch": 0}, writer(100))
    latest = ckpt.save_trainer_checkpoint(str(tmp_path), 2, {"epoch": 0}, writer(100))
    path = os.path.join(latest, name)
    with open(path, "rb") as fh:
        data = fh.read()
    changed = damage(data)
    assert changed != data and len(changed) == len(data)  # same size: the size check alone passes it
    with open(path, "wb") as fh:
        fh.write(changed)
    problem = ckpt.checkpoint_problem(latest)
    assert problem is not None and name in problem and "CRC32" in problem
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == previous


def test_every_file_gets_its_crc32_and_old_manifests_without_checksums_still_load(tmp_path):
    final = ckpt.save_trainer_checkpoint(str(tmp_path), 1, {}, writer(ckpt.CHECKSUM_MAX_BYTES + 5000))
    with open(os.path.join(final, ckpt.MANIFEST_FILE)) as fh:
        manifest = json.load(fh)
    assert set(manifest["crc32"]) == set(manifest["files"]) == {ckpt.STATE_FILE, os.path.join("rng", "rank0.pt"),
                                                                os.path.join("actor", "__0_0.distcp")}
    for name, crc in manifest["crc32"].items():
        with open(os.path.join(final, name), "rb") as fh:
            assert crc == f"{zlib.crc32(fh.read()):08x}", name
    del manifest["crc32"]  # a checkpoint written before checksums: sizes only, still complete and loadable
    with open(os.path.join(final, ckpt.MANIFEST_FILE), "w") as fh:
        json.dump(manifest, fh)
    assert ckpt.checkpoint_problem(final) is None
    assert ckpt.load_trainer_state(final)["step"] == 1


def _replay_buffer(tokens_per_trajectory):
    buffer = ReplayBuffer(8, "drop", lambda index, epoch, step: PromptGroup(
        uid=f"{epoch}-{index}", index=index, epoch=epoch, submit_step=step, prompt=[1, 2], fields={}, n=2),
        PromptStream(ResumableSampler(4, shuffle=False, seed=0)))
    for group in buffer.submit(2, step=1):
        for t in group.trajectories:
            t.tokens = list(range(100_000, 100_000 + tokens_per_trajectory))
            t.log_probs, t.finished, t.min_version, t.max_version = [-0.5] * tokens_per_trajectory, True, 0, 0
    buffer.collect_finished()
    return buffer


def test_a_flipped_bit_in_a_large_replay_buffer_shard_fails_the_resume_naming_the_file(tmp_path):
    buffer = _replay_buffer(40_000)
    final = ckpt.save_trainer_checkpoint(str(tmp_path), 1, {}, lambda staging: buffer.save_trajectories(staging, 0, 1))
    shard = os.path.join(final, "replay_buffer", "shard0-of-1.pt")
    with open(shard, "rb") as fh:
        data = bytearray(fh.read())
    assert len(data) > ckpt.CHECKSUM_MAX_BYTES  # beyond the files the completeness check reads
    data[data.index((123_456).to_bytes(8, "little"))] ^= 0x01  # token 123456 becomes 123457
    with open(shard, "wb") as fh:
        fh.write(data)
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == final  # sizes match: complete, and picked
    assert ReplayBuffer.load_trajectories(final)[0][0].tokens[23_456] == 123_457  # torch.load does not notice
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_trainer_state(final)
    message = str(err.value)
    assert "\n" not in message and shard in message, message
    assert re.search(r"expected CRC32 [0-9a-f]{8}, found [0-9a-f]{8}", message), message
    assert exit_code(err.value) == 2


def test_a_process_forked_during_a_save_does_not_keep_its_staging_lock(tmp_path):
    """A checkpoint writer's worker forked by rank 0 mid-save shares the lock's open file. When the rank is killed
    (its descriptors closed by the kernel) while such a child lives on, the staging must read as abandoned, not as
    "a save running" that blocks the requeued job's save of the same step (seen once in CI: colocate_async's
    resume after SIGKILL)."""
    staging = str(tmp_path / "global_step_4.tmp")
    fd = ckpt._lock_staging(staging)
    assert ckpt._staging_alive(staging)
    release_r, release_w = os.pipe()
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # the forked worker: running (past fork's handlers), then outliving the save until told to go
        os.close(release_w)
        os.write(ready_w, b"x")
        os.read(release_r, 1)
        os._exit(0)
    os.close(release_r)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
        ckpt._HELD_LOCKS.discard(fd)
        os.close(fd)  # the rank dies: the kernel closes its descriptors, the lock file stays behind
        assert os.path.exists(staging + ckpt.STAGING_LOCK)
        assert not ckpt._staging_alive(staging)
    finally:
        os.write(release_w, b"x")
        os.close(release_w)
        os.close(ready_r)
        os.waitpid(child, 0)
