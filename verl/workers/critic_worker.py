"""The critic (value model), colocated with the actor: values and PPO value updates.

On Megatron it shares the actor's (t, p, d) layout (one parallel state per process) and its batches are
split over Megatron DP replicas (MEGATRON_COMPUTE_PROTO); on FSDP (``critic.strategy=fsdp``) it shares the
actor's mesh and every rank is a DP replica. LoRA: ``critic.model``'s keys, as the actor's (:mod:`verl.engine.lora`);
the adapters and the value head train.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl.algorithms import core_algos
from verl.engine.base import EngineSpec
from verl.engine.registry import build_engine
from verl.engine.roles import Critic
from verl.models.config import ModelConfig
from verl.protocol import DataProto
from verl.single_controller import Dispatch, MeshRank, Worker, register
from verl.workers import role_utils
from verl.workers.config import CriticConfig


def value_loss_fn(cfg: CriticConfig, counts: dict[str, int]) -> Callable:
    """verl's clipped value loss for ``update_critic`` with ``global_loss=True``, aggregated with the
    mini-batch's global ``counts`` (:func:`role_utils.global_batch_info`) and ``critic.loss_scale_factor``."""

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
        vpreds, mask = outputs["values"], mb["response_mask"]
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            vpreds=vpreds, returns=mb["returns"], values=mb["values"], response_mask=mask,
            cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode,
            loss_scale_factor=cfg.get("loss_scale_factor"), **counts)  # not a key of the packaged critic section
        vpred_mean = (vpreds * mask).sum() / mask.sum().clamp(min=1)
        return vf_loss, {"critic/vf_loss": vf_loss, "critic/vf_clipfrac": vf_clipfrac,
                         "critic/vpred_mean": vpred_mean}

    return loss_fn


class CriticWorker(Worker):
    """``rollout_n``: responses per prompt (a mini-batch's rows); ``seed``: trainer.seed."""

    def __init__(self, config: CriticConfig, total_training_steps: int = 1, *, rollout_n: int, seed: int):
        self.config = config
        self.strategy = self.config.strategy
        self.n = rollout_n
        model_config = ModelConfig.from_pretrained(self.config.model.path)
        budget = role_utils.token_budget
        options = dict(micro_batch_size=self.config.ppo_micro_batch_size_per_gpu,
                       max_token_len=budget(self.config, "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
                       forward_max_token_len=budget(self.config, "use_dynamic_bsz", "forward_max_token_len_per_gpu"))
        # critic.model's use_remove_padding / enable_gradient_checkpointing (default: the actor's); on Megatron
        # the actor's layout (checked at config time: one parallel state per process).
        engine = build_engine(self.strategy, EngineSpec(
            model_config, self.config.model.path, "value", self.config, self.config.model, self.config.optim,
            total_training_steps, seed=seed))
        self.critic = Critic(engine, **options)
        self.dp_size = engine.dp_size

    def dispatch_meshes(self) -> dict[str, MeshRank]:
        return {"megatron": role_utils.dp_mesh(self.critic.engine)}

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, reads=role_utils.ACTOR_FIELDS)
    def compute_values(self, data: DataProto) -> DataProto:
        """values [B, R]: V of the prefix before each response token."""
        out = self.critic.compute_values(role_utils.batch_fields(data, role_utils.ACTOR_FIELDS))
        return DataProto.from_dict({"values": out["values"]})

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO,
              reads=role_utils.ACTOR_FIELDS + ("response_mask", "values", "returns"))
    def update_critic(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches of the value loss; meta_info["metrics"] averaged over steps."""
        cfg = self.config
        fields = role_utils.batch_fields(data, role_utils.ACTOR_FIELDS + ("response_mask", "values", "returns"))
        mini = cfg.ppo_mini_batch_size * self.n // self.dp_size
        steps = []
        seed = int(data.meta_info.get("seed", 0))
        for batch in role_utils.ppo_mini_batches(fields, mini, cfg.ppo_epochs, cfg.shuffle, seed):
            counts = role_utils.global_batch_info(batch["response_mask"], self.critic.engine.dp_group)
            loss_fn = value_loss_fn(cfg, counts)
            m = self.critic.update_critic(batch, loss_fn, global_loss=True, summed_metrics=("critic/vf_loss",))
            steps.append({k: v for k, v in m.items() if k.startswith("critic/")}
                         | {"critic/grad_norm": m["grad_norm"], "critic/lr": m["lr"]})
        return DataProto(meta_info={"metrics": role_utils.mean_metrics(steps)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Model + optimizer; the iteration recorded is the optimizer's step count (Adam's t)."""
        self.critic.engine.save_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        return self.critic.engine.load_checkpoint(path)
