"""Reward-model hot swap triggers (no model): the watched path's fingerprint and the trainer's
between-step decision, plus the token-level placement of sequence scores."""

import os
import time

import torch

from verl.trainer.config import load_config
from verl.trainer.config.sections import PPOSections
from verl.trainer.ppo.context import PhaseTimer, Roles
from verl.trainer.ppo.reward_swap import RewardModelSwap
from verl.workers.reward_model_worker import checkpoint_fingerprint, token_level_rm_scores


def write_checkpoint(path, payload):
    os.makedirs(path)
    with open(os.path.join(path, "model.safetensors"), "w") as fh:
        fh.write(payload)


def test_fingerprint_changes_when_the_directory_is_replaced_by_rename_or_symlink(tmp_path):
    write_checkpoint(tmp_path / "v1", "a")
    write_checkpoint(tmp_path / "v2", "a")
    link = tmp_path / "current"
    os.symlink(tmp_path / "v1", link)
    before = checkpoint_fingerprint(str(link))
    assert checkpoint_fingerprint(str(link)) == before
    os.remove(link)
    os.symlink(tmp_path / "v2", link)
    assert checkpoint_fingerprint(str(link)) != before
    replaced = checkpoint_fingerprint(str(tmp_path / "v2"))
    write_checkpoint(tmp_path / "v3", "a")
    os.rename(tmp_path / "v2", tmp_path / "old")
    os.rename(tmp_path / "v3", tmp_path / "v2")
    assert checkpoint_fingerprint(str(tmp_path / "v2")) != replaced


class RecordingRewardModelGroup:
    def __init__(self):
        self.swaps = []

    def swap_reward_model(self, path):
        self.swaps.append(path)


def swap_with(tmp_path, **hot_swap):
    """The trainer's reward-model swap as the trainer builds it (rank 0, a recording reward-model group)."""
    config = load_config(None, [f"reward_model.model.path={tmp_path / 'rm'}",
                                *(f"reward_model.hot_swap.{k}={v}" for k, v in hot_swap.items())], resolve_only=True)
    roles = Roles(actor_rollout_wg=None, rm_wg=RecordingRewardModelGroup())
    return RewardModelSwap(PPOSections.from_tree(config, ""), roles, PhaseTimer(print), rank=0, say=print)


def test_watch_swaps_once_after_the_path_changes(tmp_path):
    write_checkpoint(tmp_path / "rm", "a")
    swap = swap_with(tmp_path, watch=True)
    assert swap.maybe_swap(1) == {"reward_model/swapped": 0.0}
    time.sleep(0.01)
    write_checkpoint(tmp_path / "rm_new", "bb")
    os.rename(tmp_path / "rm", tmp_path / "rm_old")
    os.rename(tmp_path / "rm_new", tmp_path / "rm")
    assert swap.maybe_swap(2) == {"reward_model/swapped": 1.0}
    assert swap.maybe_swap(3) == {"reward_model/swapped": 0.0}
    assert swap.roles.rm_wg.swaps == [str(tmp_path / "rm")]


def test_scheduled_swap_happens_at_its_step_only(tmp_path):
    write_checkpoint(tmp_path / "rm", "a")
    swap = swap_with(tmp_path, path=str(tmp_path / "rm_b"), at_step=2)
    swapped = [swap.maybe_swap(step)["reward_model/swapped"] for step in (1, 2, 3)]
    assert swapped == [0.0, 1.0, 0.0]
    assert swap.roles.rm_wg.swaps == [str(tmp_path / "rm_b")] and swap.path == str(tmp_path / "rm_b")


def test_sequence_scores_land_on_the_last_valid_response_token():
    # rows: response lengths 3, 1, 0 (prompt columns 0-1, response columns 2-4)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    out = token_level_rm_scores(torch.tensor([0.5, -2.0, 7.0]), mask, response_length=3)
    assert out.tolist() == [[0.0, 0.0, 0.5], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
