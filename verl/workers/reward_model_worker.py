"""The model-based reward: a reward model (score head, on Megatron or FSDP) colocated with the actor, hot-swappable.

``compute_rm_score`` reads ``input_ids``/``attention_mask``/``position_ids`` [B, P+R] and
``responses`` [B, R] (the actor's tokens: the reward model shares the actor's tokenizer) and returns
``rm_scores`` [B, R] float32: the score head at each sequence's last valid token, placed on the last
valid response token and 0 elsewhere (verl's token-level layout). A sequence whose response is empty
has no token to carry its score, so its row is all zeros (as the rule-based reward manager does).
The reward manager passes ``rm_scores`` through as ``token_level_scores`` (verl's behaviour: with a
reward model enabled, it replaces the rule-based score).

Hot swap: ``swap_reward_model(path)`` replaces the weights between steps -- in place when the new
checkpoint has the same architecture, otherwise by rebuilding the (forward-only) engine. The trainer
calls it when ``reward_model.hot_swap.watch`` sees ``reward_model.model.path`` change, or at
``reward_model.hot_swap.at_step`` with ``reward_model.hot_swap.path`` (see ``verl/trainer/ppo/trainer.py``).

The reward model uses the actor's layout (Megatron's (t, p, d): one parallel state per process; FSDP's mesh);
its batches are split over its engine's DP replicas (MEGATRON_COMPUTE_PROTO).
"""

from __future__ import annotations

import os

import torch

from verl.engine.base import EngineSpec
from verl.engine.registry import build_engine
from verl.engine.roles import RewardModel
from verl.models.config import ModelConfig
from verl.protocol import DataProto
from verl.single_controller import Dispatch, MeshRank, Worker, register
from verl.utils.checkpoint import CheckpointError
from verl.workers.config import ActorConfig, RewardModelConfig
from verl.workers.role_utils import ACTOR_FIELDS, batch_fields, dp_mesh


def token_level_rm_scores(scores: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """Sequence scores [B] -> [B, R] with each score on its row's last valid response token."""
    response_lengths = attention_mask[:, -response_length:].sum(dim=-1).long()
    out = torch.zeros(scores.shape[0], response_length, dtype=torch.float32)
    rows = torch.nonzero(response_lengths > 0).squeeze(-1)
    out[rows, response_lengths[rows] - 1] = scores[rows].float()
    return out


def checkpoint_fingerprint(path: str) -> tuple:
    """What identifies the checkpoint at ``path`` now: its resolved location and every file's
    (name, size, mtime). A directory replaced by rename or a re-pointed symlink changes it."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        return (real,)
    entries = []
    for name in sorted(os.listdir(real)):
        stat = os.stat(os.path.join(real, name))
        entries.append((name, stat.st_size, stat.st_mtime_ns))
    return (real, os.stat(real).st_ino, tuple(entries))


class RewardModelWorker(Worker):
    """``layout_role``: the actor's section, whose parallel layout this process follows; ``seed``: trainer.seed
    (the random init of a model given by its config alone)."""

    def __init__(self, config: RewardModelConfig, *, layout_role: ActorConfig, seed: int):
        self.config = config
        self.strategy = self.config.strategy
        self.seed = seed
        self.layout_role = layout_role
        self.rm = None
        self.model_path = None
        self._load(self.config.model.path)

    def _load(self, path: str) -> None:
        if not os.path.isdir(path):
            raise CheckpointError(f"reward model: expected an HF checkpoint directory, found nothing at {path}")
        spec = EngineSpec(ModelConfig.from_pretrained(path), path, "score", self.config, seed=self.seed,
                          layout_role=self.layout_role)
        # Forward-only: a swap loads in place where the engine can, else rebuilds (no optimizer state is lost).
        engine = build_engine(self.strategy, spec) if self.rm is None else self.rm.engine.swap_hf_weights(spec)
        self.rm = RewardModel(engine, micro_batch_size=self.config.micro_batch_size_per_gpu)
        self.model_path = path

    def dispatch_meshes(self) -> dict[str, MeshRank]:
        return {"megatron": dp_mesh(self.rm.engine)}

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, reads=ACTOR_FIELDS)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """rm_scores [B, R]: the sequence score on the last valid response token."""
        fields = batch_fields(data, ACTOR_FIELDS)
        scores = self.rm.compute_rm_score(fields)["rm_scores"]
        return DataProto.from_dict({"rm_scores": token_level_rm_scores(
            scores, fields["attention_mask"], fields["responses"].shape[-1])})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def swap_reward_model(self, path: str) -> str:
        """Load the reward model at ``path`` (an HF directory with a ``score.weight``); returns the path."""
        self._load(path)
        return self.model_path
