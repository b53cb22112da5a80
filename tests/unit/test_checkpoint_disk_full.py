"""A full disk during a checkpoint: one DiskFullError naming the last complete checkpoint, nothing half-written
kept, stale staging from a killed save removed (a live save's left alone), and a save that lacks room pruned (or
refused) before it starts. The full disk is recognised however the writer reports it: an OSError, torch.save's
RuntimeError (with the OSError as its context, or with no errno at all), a message naming ENOSPC.
The other writers of a run too: an HF export (no staging left, the previous export kept) and metrics.jsonl (one
line, no torn record).

The file system is a real one that fills up: a small tmpfs mounted for the test (the suite runs as root)."""

import errno
import os
import socket
import subprocess
import sys

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
    for step in (6, 7):
        (root / f"global_step_{step}.tmp" / "actor").mkdir(parents=True)
        (root / f"global_step_{step}.tmp" / "actor" / "part").write_bytes(b"x" * 10)
    (root / "global_step_7.tmp.lock").write_text(f"{socket.gethostname()} 1\n")  # its saver died: lock free
    (root / (ckpt.LATEST_FILE + ".tmp")).write_text("7\n")
    ckpt.save_trainer_checkpoint(str(root), 8, {}, writer(10))
    assert sorted(os.listdir(root)) == ["global_step_8", ckpt.LATEST_FILE]


def test_a_live_saves_staging_is_left_alone_by_another_runs_cleanup(tmp_path):
    root = str(tmp_path / "ckpt")
    seen = {}

    def save_models(staging):  # meanwhile another run saving into the same directory cleans up before its save
        seen["removed"], seen["staging kept"] = ckpt.clean_stale_staging(root), os.path.isdir(staging)
        writer(10)(staging)

    final = ckpt.save_trainer_checkpoint(root, 3, {}, save_models)
    assert seen == {"removed": [], "staging kept": True}
    assert ckpt.checkpoint_problem(final) is None
    assert sorted(os.listdir(root)) == ["global_step_3", ckpt.LATEST_FILE]


def test_without_flock_the_savers_pid_on_this_host_decides(tmp_path, monkeypatch):
    def no_flock(fd, operation):  # Lustre mounted without -o flock
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(ckpt.fcntl, "flock", no_flock)
    root = tmp_path / "ckpt"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        for step, owner in ((1, f"{socket.gethostname()} {live.pid}"), (2, f"{socket.gethostname()} {gone.pid}"),
                            (3, "another-node 12")):
            (root / f"global_step_{step}.tmp").mkdir(parents=True)
            (root / f"global_step_{step}.tmp.lock").write_text(owner + "\n")
        ckpt.save_trainer_checkpoint(str(root), 4, {}, writer(10))
    finally:
        live.kill()
        live.wait()
    assert sorted(os.listdir(root)) == ["global_step_1.tmp", "global_step_1.tmp.lock", "global_step_3.tmp",
                                        "global_step_3.tmp.lock", "global_step_4", ckpt.LATEST_FILE]


def _torch_save_to_a_path(staging):  # its RuntimeError ('unexpected pos ...') carries no errno at all
    torch.save({"w": torch.ones(200_000)}, os.path.join(staging, "weights.pt"))


def _torch_save_to_a_file(staging):  # its RuntimeError has the OSError as its context
    with open(os.path.join(staging, "weights.pt"), "wb") as fh:
        torch.save({"w": torch.ones(200_000)}, fh)


@pytest.mark.parametrize("save_models", [_torch_save_to_a_path, _torch_save_to_a_file])
def test_a_full_disk_inside_torch_save_is_a_disk_full_error_too(small_fs, save_models):
    root = str(small_fs / "ckpt")
    first = ckpt.save_trainer_checkpoint(root, 1, {}, writer(100 * KB))
    with pytest.raises(ckpt.DiskFullError) as err:
        ckpt.save_trainer_checkpoint(root, 2, {}, save_models)  # 800 KB: more than the file system
    message = str(err.value)
    assert "\n" not in message and "step 2 not saved" in message and "No space left on device" in message
    assert f"the last complete checkpoint is {first}" in message, message
    assert sorted(os.listdir(root)) == ["global_step_1", ckpt.LATEST_FILE]


def test_an_error_that_only_names_enospc_is_a_full_disk(tmp_path):
    def megatron_writer(staging):  # what Megatron's writer processes send back: the OSError as text
        raise RuntimeError("Worker failure: [Errno 28] No space left on device: '__0_0.distcp'")
    with pytest.raises(ckpt.DiskFullError, match="rank 0: No space left on device"):
        ckpt.save_trainer_checkpoint(str(tmp_path / "ckpt"), 1, {}, megatron_writer)


def test_other_errors_are_not_reported_as_a_full_disk(tmp_path):
    def denied(staging):
        raise PermissionError(13, "Permission denied", staging)
    with pytest.raises(PermissionError):
        ckpt.save_trainer_checkpoint(str(tmp_path / "ckpt"), 1, {}, denied)

    def bug(staging):
        raise RuntimeError("unexpected pos 576 vs 534")  # as torch.save's, on a disk with room
    with pytest.raises(RuntimeError, match="unexpected pos"):
        ckpt.save_trainer_checkpoint(str(tmp_path / "ckpt"), 2, {}, bug)


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
