"""The model-based reward: a reward model (score head, on Megatron or FSDP) colocated with the actor, hot-swappable.

``compute_rm_score`` reads ``input_ids``/``attention_mask``/``position_ids`` [B, P+R] and
``responses`` [B, R] (the actor's tokens) and returns ``rm_scores`` [B, R] float32: the sequence score placed
on the last valid response token of the actor's layout and 0 elsewhere (verl's token-level layout). A sequence
whose response is empty has no token to carry its score, so its row is all zeros (as the rule-based reward
manager does).

Which model and which tokens (:mod:`verl.workers.reward_model.plan`): a decoder ``*ForSequenceClassification``
(Llama, Qwen2, ...) runs on the role's training engine (Megatron or FSDP, score head); any other classifier (an
encoder: BERT, DeBERTa-v2/v3) is transformers' module on every rank (:mod:`.reward_model.replicated`). An RM with
its own tokenizer (``reward_model.model.input_tokenizer`` = the actor's, verl's switch; always for an encoder)
scores the decoded prompt + response re-encoded with its tokenizer and chat template, truncated to
``reward_model.max_length`` (else its max_position_embeddings) from the left
(:mod:`.reward_model.retokenize`); the share of rows cut is the metric ``reward_model/truncated_frac``.
The reward manager passes ``rm_scores`` through as ``token_level_scores`` (verl's behaviour: with a
reward model enabled, it replaces the rule-based score).

A generative reward model (``reward.reward_model.judge.prompt_template`` set): an LLM judge served by a rollout
engine on every rank, its verdicts parsed into the sequence scores (:mod:`verl.workers.reward_judge`), with the
metrics ``reward_model/judge_*``.

Hot swap: ``swap_reward_model(path)`` replaces the weights between steps -- in place when the new
checkpoint has the same architecture, otherwise by rebuilding the (forward-only) engine. The trainer
calls it when ``reward_model.hot_swap.watch`` sees ``reward_model.model.path`` change, or at
``reward_model.hot_swap.at_step`` with ``reward_model.hot_swap.path`` (see ``verl/trainer/ppo/trainer.py``).

The reward model uses the actor's layout (Megatron's (t, p, d): one parallel state per process; FSDP's mesh);
its batches are split over its engine's DP replicas (MEGATRON_COMPUTE_PROTO).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from verl.engine.base import EngineSpec
from verl.engine.registry import build_engine
from verl.engine.roles import RewardModel
from verl.models.config import ModelConfig
from verl.protocol import DataProto
from verl.single_controller import Dispatch, MeshRank, Worker, register
from verl.utils.checkpoint import CheckpointError
from verl.utils.config_checks import ConfigError
from verl.workers.config import ActorConfig, RewardModelConfig
from verl.workers.reward_model.plan import RewardModelPlan, load_tokenizer, plan_reward_model
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

    def __init__(self, config: RewardModelConfig, *, layout_role: ActorConfig, seed: int, judge: Any = None):
        """``judge``: ``reward.reward_model`` (its ``judge.prompt_template`` set: the model is an LLM judge,
        :mod:`verl.workers.reward_judge`)."""
        self.config = config
        self.judge_section = judge if judge is not None and judge.is_judge else None
        self.strategy = self.config.strategy
        self.seed = seed
        self.layout_role = layout_role
        self.rm = None
        self.plan: RewardModelPlan | None = None
        self.retokenizer = None
        self.model_path = None
        self._actor_tokenizer = None
        self._load(self.config.model.path)

    def _load(self, path: str) -> None:
        if not os.path.isdir(path):
            raise CheckpointError(f"reward model: expected an HF checkpoint directory, found nothing at {path}")
        if self.judge_section is not None:
            import torch.distributed as dist

            from verl.workers.reward_judge import Judge

            if self._actor_tokenizer is None:
                self._actor_tokenizer = load_tokenizer(self.config.model.input_tokenizer,
                                                       "reward_model.model.input_tokenizer")
            if isinstance(self.rm, Judge):
                self.rm.close()
            self.rm = Judge(path, self.judge_section, self._actor_tokenizer, self.seed,
                            rank=dist.get_rank() if dist.is_initialized() else 0)
            self.plan, self.retokenizer, self.model_path = None, None, path
            return
        plan = plan_reward_model(path, self.config.model.input_tokenizer)
        self.retokenizer = self._retokenizer(plan) if plan.retokenize else None
        if plan.engine == "replicated":
            from verl.workers.reward_model.replicated import ReplicatedRewardModel

            self.rm = ReplicatedRewardModel(path, micro_batch_size=self.config.micro_batch_size_per_gpu)
        else:
            spec = EngineSpec(ModelConfig.from_pretrained(path), path, "score", self.config, seed=self.seed,
                              layout_role=self.layout_role)
            # Forward-only: a swap loads in place where the engine can, else rebuilds (no optimizer state is lost).
            engine = build_engine(self.strategy, spec) if not isinstance(self.rm, RewardModel) \
                else self.rm.engine.swap_hf_weights(spec)
            self.rm = RewardModel(engine, micro_batch_size=self.config.micro_batch_size_per_gpu)
        self.plan = plan
        self.model_path = path

    def _retokenizer(self, plan: RewardModelPlan):
        from verl.workers.reward_model.retokenize import Retokenizer

        if self.config.model.input_tokenizer is None:
            raise ConfigError(f"reward_model.model.input_tokenizer: expected the actor's tokenizer to decode "
                              f"responses for the reward model at {plan.path} (it has its own tokenizer), found null")
        if self._actor_tokenizer is None:
            self._actor_tokenizer = load_tokenizer(self.config.model.input_tokenizer,
                                                   "reward_model.model.input_tokenizer")
        max_length = self.config.max_length if self.config.max_length is not None else plan.max_position_embeddings
        return Retokenizer(self._actor_tokenizer, load_tokenizer(plan.path, "reward_model.model.path"),
                           plan.template, max_length)

    def dispatch_meshes(self) -> dict[str, MeshRank]:
        if isinstance(self.rm, RewardModel):
            return {"megatron": dp_mesh(self.rm.engine)}
        import torch.distributed as dist  # replicated: every rank is a DP replica

        return {"megatron": MeshRank(dist.get_rank(), dist.get_world_size(), True)}

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, reads=ACTOR_FIELDS)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """rm_scores [B, R]: the sequence score on the last valid response token. With the RM's own tokenizer,
        ``meta_info["metrics"]`` carries ``reward_model/truncated_frac``."""
        fields = batch_fields(data, ACTOR_FIELDS)
        response_length = fields["responses"].shape[-1]
        meta = {}
        if self.judge_section is not None:
            scores, metrics, _ = self.rm.score(fields, data.non_tensor_batch, response_length)
            meta = {"metrics": metrics}
        elif self.retokenizer is None:
            scores = self.rm.compute_rm_score(fields)["rm_scores"]
        else:
            raw = data.non_tensor_batch.get("raw_prompt") if data.non_tensor_batch else None
            batch, truncated = self.retokenizer.encode(fields["input_ids"], fields["attention_mask"], response_length,
                                                       raw_prompts=raw)
            if isinstance(self.rm, RewardModel):
                batch.pop("token_type_ids", None)  # decoders have no segment embeddings
                scores = self.rm.compute_rm_score(batch)["rm_scores"]
            else:
                scores = self.rm.score(batch)
            meta = {"metrics": {"reward_model/truncated_frac": float(truncated.float().mean()) if len(truncated)
                                else 0.0}}
        return DataProto.from_dict({"rm_scores": token_level_rm_scores(
            scores, fields["attention_mask"], response_length)}, meta_info=meta)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def swap_reward_model(self, path: str) -> str:
        """Load the reward model at ``path`` (an HF directory with a ``score.weight``); returns the path."""
        self._load(path)
        return self.model_path
