"""A full disk during a checkpoint: one DiskFullError naming the last complete checkpoint, nothing half-written
kept, stale staging from a killed save removed, and a save that lacks room pruned (or refused) before it starts.
The other writers of a run too: an HF export (no staging left, the previous export kept) and metrics.jsonl (one
line, no torn record).

The file system is a real one that fills up: a small tmpfs mounted for the test (the suite runs as root)."""

import os
import subprocess

import pytest
import torch

from verl.models.hf_io import HFCheckpoint, write_hf_dir
from verl.utils import checkpoint as ckpt
from verl.utils.tracking import Tracking, read_metrics

pytestmark = pytest.mark.unit
KB = 1024


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], check=True, timeout=30)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def writer(nbytes):
    def save_models(staging):
        os.makedirs(os.path.join(staging, "actor"))
        with open(os.path.join(staging, "actor", "weights.bin"), "wb") as fh:
            fh.write(b"w" * nbytes)
    return save_models


def test_running_out_of_space_mid_save_keeps_the_last_checkpoint_and_names_it(small_fs):
    root = str(small_fs / "ckpt")
    first = ckpt.save_trainer_checkpoint(root, 1, {}, writer(100 * KB))
    with pytest.raises(ckpt.DiskFullError) as err:
        ckpt.save_trainer_checkpoint(root, 2, {}, writer(700 * KB))  # larger than the file system
    message = str(err.value)
    assert "\n" not in message and "step 2 not saved" in message and "No space left on device" in message
    assert f"the last complete checkpoint is {first}" in message, message
    assert sorted(os.listdir(root)) == ["global_step_1", ckpt.LATEST_FILE]  # no staging, no step 2
    assert ckpt.find_resume_dir(root, "auto") == first


def test_a_save_that_cannot_fit_is_pruned_first_or_refused_before_writing(small_fs):
    root = str(small_fs / "ckpt")
    for step in (1, 2):
        ckpt.save_trainer_checkpoint(root, step, {}, writer(200 * KB))
    # 400 KB used of 600: a third 200 KB checkpoint does not fit beside two. Keeping 2 allows pruning to 1 first.
    third = ckpt.save_trainer_checkpoint(root, 3, {}, writer(200 * KB), max_to_keep={"actor": 2, "critic": None})
    assert ckpt.find_resume_dir(root, "auto") == third
    assert not os.path.exists(os.path.join(root, "global_step_1"))


def test_a_save_without_room_beside_the_newest_checkpoint_is_refused_before_writing(small_fs):
    root = str(small_fs / "ckpt")
    first = ckpt.save_trainer_checkpoint(root, 1, {}, writer(350 * KB))  # two of these do not fit in 600 KB
    with pytest.raises(ckpt.DiskFullError) as err:
        ckpt.save_trainer_checkpoint(root, 2, {}, writer(350 * KB), max_to_keep={"actor": 1, "critic": None})
    message = str(err.value)
    assert "expected 0.4 MiB free for it" in message and "found 0.2 MiB" in message, message
    assert "max_actor_ckpt_to_keep" in message and f"the last complete checkpoint is {first}" in message, message
    assert sorted(os.listdir(root)) == ["global_step_1", ckpt.LATEST_FILE]


def test_staging_left_by_a_killed_save_is_removed_at_the_next_save(tmp_path):
    root = tmp_path / "ckpt"
    (root / "global_step_7.tmp" / "actor").mkdir(parents=True)
    (root / "global_step_7.tmp" / "actor" / "part").write_bytes(b"x" * 10)
    (root / (ckpt.LATEST_FILE + ".tmp")).write_text("7\n")
    ckpt.save_trainer_checkpoint(str(root), 8, {}, writer(10))
    assert sorted(os.listdir(root)) == ["global_step_8", ckpt.LATEST_FILE]


def test_other_os_errors_are_not_reported_as_a_full_disk(tmp_path):
    def denied(staging):
        raise PermissionError(13, "Permission denied", staging)
    with pytest.raises(PermissionError):
        ckpt.save_trainer_checkpoint(str(tmp_path / "ckpt"), 1, {}, denied)


def test_an_hf_export_that_runs_out_of_space_keeps_the_previous_one_and_no_staging(small_fs):
    out = write_hf_dir(str(small_fs / "hf"), [("w", torch.ones(1000))], {"model_type": "qwen2"})
    with pytest.raises(ckpt.DiskFullError) as err:
        write_hf_dir(out, [("w", torch.ones(200_000))], {"model_type": "qwen2"})  # 800 KB: more than the disk
    message = str(err.value)
    assert "\n" not in message and f"HF export {out} not written" in message, message
    assert "No space left on device" in message and "nothing of it was kept" in message, message
    assert sorted(os.listdir(small_fs)) == ["hf"]  # no .tmp-<host>-<pid> left
    assert torch.equal(HFCheckpoint(out).get("w"), torch.ones(1000))


def test_metrics_jsonl_on_a_full_disk_is_one_line_and_keeps_whole_records(small_fs):
    tracking = Tracking(str(small_fs / "run"), backends=())
    tracking.log({"actor/pg_loss": 0.5}, 1)
    with open(small_fs / "filler", "wb") as fh:  # fill the disk but for a few KB
        fh.write(b"f" * (600 * KB - 3 * 4096))
    with pytest.raises(ckpt.DiskFullError) as err:
        tracking.log({f"m{i}": float(i) for i in range(2000)}, 2)  # a ~20 KB record
    message = str(err.value)
    assert "\n" not in message and "metrics.jsonl" in message and "logging step 2" in message, message
    assert "No space left on device" in message, message
    tracking.close()
    path = small_fs / "run" / "metrics.jsonl"
    assert path.read_bytes().endswith(b"\n")  # no torn record
    assert [r["step"] for r in read_metrics(str(path))] == [1]
