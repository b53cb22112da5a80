"""Auto-resume never trusts a cut checkpoint: a manifest with every file's size is written last (a directory
without one is incomplete), and a bad latest checkpoint (a cut shard, a garbled state file or
latest_checkpointed_iteration.txt) gives one warning naming the bad file and the newest complete checkpoint is
used instead; so does a `latest` that names an older complete one."""

import json
import logging

import pytest

from verl.utils import checkpoint as ckpt

pytestmark = pytest.mark.unit


def _fake_checkpoint(root, step, shard_bytes=100):
    path = root / f"global_step_{step}"
    (path / "actor").mkdir(parents=True)
    (path / "actor" / "__0_0.distcp").write_bytes(b"w" * shard_bytes)
    (path / ckpt.STATE_FILE).write_text(json.dumps({"step": step}))
    ckpt.write_manifest(str(path))
    (root / ckpt.LATEST_FILE).write_text(f"{step}\n")
    return path


@pytest.fixture
def verl_warnings(caplog, monkeypatch):
    monkeypatch.setenv("VERL_LOGGING_ALL_RANKS", "1")
    caplog.set_level(logging.WARNING, logger="verl")
    return caplog


def test_complete_latest_checkpoint_is_used(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    latest = _fake_checkpoint(tmp_path, 4)
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == str(latest)
    assert ckpt.checkpoint_problem(str(latest)) is None


@pytest.mark.parametrize("damage, bad_file", [
    (lambda p: (p / "actor" / "__0_0.distcp").write_bytes(b"w" * 10), "__0_0.distcp"),
    (lambda p: (p / "actor" / "__0_0.distcp").unlink(), "__0_0.distcp"),
    (lambda p: (p / ckpt.STATE_FILE).write_text("{garbled"), ckpt.STATE_FILE),
    (lambda p: (p / ckpt.MANIFEST_FILE).write_text("[1, 2"), ckpt.MANIFEST_FILE),
])
def test_a_cut_latest_checkpoint_falls_back_to_the_newest_complete_one(tmp_path, verl_warnings, damage, bad_file):
    previous = _fake_checkpoint(tmp_path, 2)
    damage(_fake_checkpoint(tmp_path, 4))
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == str(previous)
    warned = [r.getMessage() for r in verl_warnings.records if "incomplete" in r.getMessage()]
    assert len(warned) == 1 and bad_file in warned[0] and str(previous) in warned[0], warned


def test_a_garbled_latest_file_falls_back_too(tmp_path, verl_warnings):
    newest = _fake_checkpoint(tmp_path, 3)
    (tmp_path / ckpt.LATEST_FILE).write_text("three\n")
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == str(newest)
    assert any(ckpt.LATEST_FILE in r.getMessage() for r in verl_warnings.records)


def test_no_complete_checkpoint_starts_over_with_a_warning_and_explicit_ones_raise(tmp_path, verl_warnings):
    bad = _fake_checkpoint(tmp_path, 5)
    (bad / "actor" / "__0_0.distcp").write_bytes(b"")
    assert ckpt.find_resume_dir(str(tmp_path), "auto") is None
    assert any("starting over" in r.getMessage() for r in verl_warnings.records)
    with pytest.raises(ckpt.CheckpointError, match="expected 100 bytes, found 0"):
        ckpt.find_resume_dir(str(tmp_path), str(bad))
    with pytest.raises(ckpt.CheckpointError, match="trainer.resume_from_path"):
        ckpt.find_resume_dir(str(tmp_path), "resume_path", str(bad))
    assert ckpt.find_resume_dir(str(tmp_path / "empty"), "auto") is None


def test_a_directory_without_a_manifest_is_not_complete(tmp_path, verl_warnings):
    previous = _fake_checkpoint(tmp_path, 2)
    cut = tmp_path / "global_step_4"  # every file in place, but the save died before its manifest
    (cut / "actor").mkdir(parents=True)
    (cut / "actor" / "__0_0.distcp").write_bytes(b"w" * 100)
    (cut / ckpt.STATE_FILE).write_text(json.dumps({"step": 4}))
    (tmp_path / ckpt.LATEST_FILE).write_text("4\n")
    assert ckpt.MANIFEST_FILE in ckpt.checkpoint_problem(str(cut))
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == str(previous)
    with pytest.raises(ckpt.CheckpointError, match=ckpt.MANIFEST_FILE):
        ckpt.find_resume_dir(str(tmp_path), str(cut))


def test_the_newest_complete_step_wins_over_an_older_latest(tmp_path, verl_warnings):
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    (tmp_path / ckpt.LATEST_FILE).write_text("2\n")  # the save of step 4 died between its rename and `latest`
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == str(newest)
    warned = [r.getMessage() for r in verl_warnings.records if ckpt.LATEST_FILE in r.getMessage()]
    assert len(warned) == 1 and str(newest) in warned[0] and "global_step_2" in warned[0], warned


# ----------------------------------------------------------------------------- max_*_ckpt_to_keep
def _full_checkpoint(root, step, parts=("actor", "critic")):
    path = root / f"global_step_{step}"
    for part in parts:
        (path / part).mkdir(parents=True)
        (path / part / "__0_0.distcp").write_bytes(b"w" * 10)
    (path / ckpt.STATE_FILE).write_text(json.dumps({"step": step}))
    ckpt.write_manifest(str(path))
    (root / ckpt.LATEST_FILE).write_text(f"{step}\n")
    return path


def _parts(root):
    return {p.name: sorted(c.name for c in p.iterdir() if c.is_dir() and c.name in ("actor", "critic"))
            for p in sorted(root.iterdir()) if p.is_dir()}


def test_prune_keeps_the_newest_actor_and_critic_parts_as_verl(tmp_path):
    for step in (1, 2, 3, 4):
        _full_checkpoint(tmp_path, step)
    removed = ckpt.prune_checkpoints(str(tmp_path), 4, {"actor": 1, "critic": 2})
    # critic: the 2 newest (3, 4) keep it; actor: only 4. Steps 1 and 2 have nothing left: removed whole.
    assert _parts(tmp_path) == {"global_step_3": ["critic"], "global_step_4": ["actor", "critic"]}
    assert sorted(removed) == sorted([str(tmp_path / "global_step_3" / "actor"), str(tmp_path / "global_step_1"),
                                      str(tmp_path / "global_step_2")])
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == str(tmp_path / "global_step_4")
    assert ckpt.checkpoint_problem(str(tmp_path / "global_step_3")) is not None  # no actor: never resumed from


def test_prune_without_limits_or_critic(tmp_path):
    for step in (2, 4, 6):
        _full_checkpoint(tmp_path, step, parts=("actor",))
    assert ckpt.prune_checkpoints(str(tmp_path), 6, {"actor": None, "critic": None}) == []
    assert len(_parts(tmp_path)) == 3
    ckpt.prune_checkpoints(str(tmp_path), 6, {"actor": 2, "critic": None})
    assert _parts(tmp_path) == {"global_step_4": ["actor"], "global_step_6": ["actor"]}


def test_prune_never_deletes_the_current_the_resume_target_or_later_steps(tmp_path):
    for step in (1, 2, 3, 5):
        _full_checkpoint(tmp_path, step)
    (tmp_path / ckpt.LATEST_FILE).write_text("3\n")  # a run resumed from step 2 just saved step 3
    ckpt.prune_checkpoints(str(tmp_path), 3, {"actor": 1, "critic": 1})
    assert _parts(tmp_path) == {"global_step_3": ["actor", "critic"], "global_step_5": ["actor", "critic"]}
    # A cut newest checkpoint is not counted: the newest complete one before it keeps its parts.
    for step in (7, 8):
        _full_checkpoint(tmp_path, step)
    (tmp_path / "global_step_8" / "actor" / "__0_0.distcp").write_bytes(b"")
    (tmp_path / ckpt.LATEST_FILE).write_text("8\n")
    ckpt.prune_checkpoints(str(tmp_path), 8, {"actor": 1, "critic": None})
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == str(tmp_path / "global_step_7")
    assert _parts(tmp_path)["global_step_7"] == ["actor", "critic"]
    assert _parts(tmp_path)["global_step_5"] == ["critic"]
