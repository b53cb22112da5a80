"""A checkpoint is on disk before it is published, and its small files are checksummed: every file and
directory is fsynced before the staging directory is renamed (and before `latest` names it), and a trainer
state or RNG file changed in place (same size) makes the checkpoint incomplete, naming the file."""

import json
import os

import pytest

from verl.utils import checkpoint as ckpt

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


def test_large_files_are_sized_not_checksummed_and_old_manifests_still_load(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "CHECKSUM_MAX_BYTES", 1000)
    final = ckpt.save_trainer_checkpoint(str(tmp_path), 1, {}, writer(5000))
    with open(os.path.join(final, ckpt.MANIFEST_FILE)) as fh:
        manifest = json.load(fh)
    shard = os.path.join("actor", "__0_0.distcp")
    assert manifest["files"][shard] == 5000 and shard not in manifest["crc32"]
    assert ckpt.STATE_FILE in manifest["crc32"]
    del manifest["crc32"]  # a checkpoint written before checksums: sizes only, still complete
    with open(os.path.join(final, ckpt.MANIFEST_FILE), "w") as fh:
        json.dump(manifest, fh)
    assert ckpt.checkpoint_problem(final) is None
