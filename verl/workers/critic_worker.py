"""The critic (value model), colocated with the actor: values and PPO value updates.

On Megatron it shares the actor's (t, p, d) layout (one parallel state per process) and its batches are
split over Megatron DP replicas (MEGATRON_COMPUTE_PROTO); on FSDP (``critic.strategy=fsdp``) it shares the
actor's mesh and every rank is a DP replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verl.engine.roles import Critic
from verl.models.config import ModelConfig
from verl.protocol import DataProto
from verl.single_controller import Dispatch, MeshRank, Worker, register
from verl.trainer.ppo import core_algos
from verl.workers.role_utils import (
    ACTOR_FIELDS,
    batch_fields,
    dp_group_and_size,
    engine_options,
    ensure_megatron,
    fsdp_dp_mesh,
    fsdp_engine,
    global_batch_info,
    is_fsdp,
    load_initial_weights,
    mean_metrics,
    megatron_mesh,
    optim_config,
    ppo_mini_batches,
    token_budget,
)


def value_loss_fn(cfg: Any, counts: dict[str, int]) -> Callable:
    """verl's clipped value loss for ``update_critic`` with ``global_loss=True``, aggregated with the
    mini-batch's global ``counts`` (:func:`role_utils.global_batch_info`) and ``critic.loss_scale_factor``."""

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
        vpreds, mask = outputs["values"], mb["response_mask"]
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            vpreds=vpreds, returns=mb["returns"], values=mb["values"], response_mask=mask,
            cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode,
            loss_scale_factor=cfg.get("loss_scale_factor"), **counts)
        vpred_mean = (vpreds * mask).sum() / mask.sum().clamp(min=1)
        return vf_loss, {"critic/vf_loss": vf_loss, "critic/vf_clipfrac": vf_clipfrac,
                         "critic/vpred_mean": vpred_mean}

    return loss_fn


class CriticWorker(Worker):
    def __init__(self, config: Any, total_training_steps: int = 1):
        self.config = config.critic
        self.strategy = self.config.get("strategy", "megatron")
        self.n = config.actor_rollout_ref.rollout.n
        model_config = ModelConfig.from_pretrained(self.config.model.path)
        options = dict(micro_batch_size=self.config.ppo_micro_batch_size_per_gpu,
                       max_token_len=token_budget(self.config, "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
                       forward_max_token_len=token_budget(self.config, "use_dynamic_bsz",
                                                          "forward_max_token_len_per_gpu"))
        if is_fsdp(self.strategy):
            optim = optim_config(self.config.optim, total_training_steps, clip_grad=self.config.get("grad_clip"))
            # critic.model's use_remove_padding / enable_gradient_checkpointing (default: the actor's).
            engine = fsdp_engine(model_config, self.config.model.path, "value", self.config,
                                 self.config.model, optim, int(config.trainer.seed))
        else:
            from verl.engine.megatron.engine import MegatronEngine

            mega = self.config.megatron  # the actor's layout (checked at config time: one parallel state per process)
            ensure_megatron(mega.tensor_model_parallel_size, mega.pipeline_model_parallel_size, mega.seed)
            engine = MegatronEngine(model_config, head="value",
                                    optim=optim_config(self.config.optim, total_training_steps,
                                                       mega.use_distributed_optimizer),
                                    **engine_options(mega, self.config.model))
            load_initial_weights(engine, self.config.model.path, model_config, "value")
        self.critic = Critic(engine, **options)
        self.dp_size = dp_group_and_size(self.strategy)[1]

    def dispatch_meshes(self) -> dict[str, MeshRank]:
        return {"megatron": fsdp_dp_mesh() if is_fsdp(self.strategy) else megatron_mesh()}

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """values [B, R]: V of the prefix before each response token."""
        out = self.critic.compute_values(batch_fields(data, ACTOR_FIELDS))
        return DataProto.from_dict({"values": out["values"]})

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches of the value loss; meta_info["metrics"] averaged over steps."""
        cfg = self.config
        fields = batch_fields(data, ACTOR_FIELDS + ("response_mask", "values", "returns"))
        mini = cfg.ppo_mini_batch_size * self.n // self.dp_size
        steps = []
        for batch in ppo_mini_batches(fields, mini, cfg.ppo_epochs, cfg.shuffle, int(data.meta_info.get("seed", 0))):
            loss_fn = value_loss_fn(cfg, global_batch_info(batch["response_mask"], self.strategy))
            m = self.critic.update_critic(batch, loss_fn, global_loss=True, summed_metrics=("critic/vf_loss",))
            steps.append({k: v for k, v in m.items() if k.startswith("critic/")}
                         | {"critic/grad_norm": m["grad_norm"], "critic/lr": m["lr"]})
        return DataProto(meta_info={"metrics": mean_metrics(steps)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Model + optimizer; the iteration recorded is the optimizer's step count (Adam's t)."""
        engine = self.critic.engine
        if is_fsdp(self.strategy):
            from verl.engine.fsdp.checkpoint import save_checkpoint as save_fsdp

            save_fsdp(engine, path, engine.optimizer_steps)
            return
        from verl.engine.megatron.checkpoint import save_checkpoint

        save_checkpoint(engine, path, int(engine.scheduler.num_steps), with_rng=False)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        if is_fsdp(self.strategy):
            from verl.engine.fsdp.checkpoint import load_checkpoint as load_fsdp

            return load_fsdp(self.critic.engine, path)
        from verl.engine.megatron.checkpoint import load_checkpoint

        return load_checkpoint(self.critic.engine, path)
