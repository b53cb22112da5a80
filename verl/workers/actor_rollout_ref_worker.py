"""Actor, rollout and reference policy colocated on every rank, joined by the 3D-HybridEngine.

The actor trains in Megatron's (p, t, d) layout; the rollout engine generates in the SGLang layout
(t_g, d_g·d); ``generate_sequences`` reshards the actor's weights into the rollout engine's flat
buffer in place (``to_rollout``), generates, and releases the rollout memory (``to_training``).
The training weights never move. The reference policy is a forward-only copy of the initial actor.

Dispatch: log-prob and update methods split the batch over Megatron DP replicas
(MEGATRON_COMPUTE_PROTO); generation splits prompts over rollout DP replicas (mesh "rollout").
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np
import torch
import torch.distributed as dist

from verl.hybrid_engine.executor import ReshardExecutor, ReshardProcessGroups, offsets_from_views
from verl.hybrid_engine.groups import derive_groups
from verl.hybrid_engine.layouts import TrainingLayout, training_param_specs
from verl.hybrid_engine.planner import plan_reshard
from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs
from verl.models.config import ModelConfig
from verl.protocol import DataProto
from verl.single_controller import Dispatch, MeshRank, Worker, make_nd_compute_dataproto_dispatch_fn, register
from verl.trainer.ppo import core_algos

ACTOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------- shared by the Megatron roles
def ensure_megatron(tp: int, pp: int, seed: int) -> None:
    """Initialise Megatron's parallel state once per process (colocated roles share it)."""
    from megatron.core import parallel_state as mpu

    from verl.workers.megatron.parallel import initialize_megatron

    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"megatron layout: expected (tp, pp) = {have} for every colocated role, found {(tp, pp)}")
        return
    initialize_megatron(tp, pp, seed=seed)


def megatron_mesh() -> MeshRank:
    """This rank's Megatron DP replica; its output is collected on the last stage's tp rank 0."""
    from megatron.core import parallel_state as mpu

    return MeshRank(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                    mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0)


def optim_config(optim: Any, total_training_steps: int, use_distributed_optimizer: bool = False):
    from verl.workers.megatron.engine import OptimConfig

    return OptimConfig(lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                       betas=tuple(optim.betas), clip_grad=optim.clip_grad, lr_warmup_steps=optim.lr_warmup_steps,
                       total_training_steps=max(1, total_training_steps), lr_decay_style=optim.lr_decay_style,
                       use_distributed_optimizer=use_distributed_optimizer)


def load_initial_weights(engine: Any, model_path: str, model_config: ModelConfig, head: str) -> None:
    """An HF directory's safetensors into ``engine``; a bare config.json keeps Megatron's seeded init."""
    from verl.models.mcore.weights import HFCheckpoint, load_hf_into_model

    if not os.path.isdir(model_path):
        return
    checkpoint = HFCheckpoint(model_path)

    def get_hf(name: str) -> torch.Tensor:
        if name == "score.weight" and head == "value":
            try:
                return checkpoint.get(name)
            except Exception:  # an LM checkpoint has no value head: start it at zero, as verl's critic does
                return torch.zeros(1, model_config.hidden_size)
        return checkpoint.get(name)

    load_hf_into_model(engine.module, model_config, get_hf, head)


def ppo_mini_batches(data: Dict[str, torch.Tensor], mini_batch_size: int, epochs: int, shuffle: bool,
                     seed: int) -> Iterator[Dict[str, torch.Tensor]]:
    """``epochs`` passes over ``data`` in mini-batches of ``mini_batch_size`` rows (seeded shuffle)."""
    size = next(iter(data.values())).shape[0]
    for epoch in range(epochs):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle \
            else torch.arange(size)
        for start in range(0, size, mini_batch_size):
            index = order[start:start + mini_batch_size]
            yield {k: v[index] for k, v in data.items()}


def mean_metrics(per_step: List[Dict[str, float]]) -> Dict[str, float]:
    keys = per_step[0].keys()
    return {k: float(np.mean([m[k] for m in per_step])) for k in keys}


def batch_fields(data: DataProto, keys: Tuple[str, ...]) -> Dict[str, torch.Tensor]:
    missing = [k for k in keys if k not in data.batch]
    if missing:
        raise KeyError(f"expected batch fields {missing}, found only {sorted(data.batch)}")
    return {k: data.batch[k] for k in keys}


# --------------------------------------------------------------------------- the hybrid engine glue
class HybridEngine:
    """Reshards the actor's Megatron weights into the rollout engine's flat buffer and back out of it.

    The actor's parameters are rebound (once) to views of one flat training buffer in
    ``training_param_specs`` order unless Megatron's distributed optimizer already keeps them in
    one buffer; the executor's copy programs address both buffers by offset.
    """

    def __init__(self, actor_engine: Any, rollout: Any, model_config: ModelConfig, training: TrainingLayout,
                 rollout_tp: int, bucket_bytes: int, dtype: str):
        from megatron.core import parallel_state as mpu

        rank = dist.get_rank()
        self.rollout = rollout
        self.groups = derive_groups(training, rollout_tp)
        flat, offsets = self._bind_training_buffer(actor_engine, model_config, training, mpu)
        plan = plan_reshard(model_config, training, RolloutLayout(rollout_tp), rank, bucket_bytes, dtype)
        j = self.groups.rollout_tp_rank[rank]
        specs = [(s.name, s.shape) for s in rollout_param_specs(model_config, rollout_tp, j)]
        self.executor = ReshardExecutor(plan, flat, offsets, specs, ReshardProcessGroups(self.groups))
        self.summary = plan.summary()

    @staticmethod
    def _bind_training_buffer(engine: Any, model_config: ModelConfig, training: TrainingLayout, mpu):
        params = dict(engine.module.named_parameters())
        buffers = getattr(engine.model, "buffers", None) or []
        param_data = [b.param_data for b in buffers if getattr(b, "param_data", None) is not None]
        if len(param_data) == 1:  # distributed optimizer: parameters already live in one buffer
            return param_data[0], offsets_from_views(param_data[0], params)
        specs = training_param_specs(model_config, training.tp, training.pp,
                                     mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank())
        missing = [name for name, _ in specs if name not in params]
        if missing:
            raise KeyError(f"hybrid engine: expected Megatron parameters {missing[:3]}, found {sorted(params)[:6]}...")
        total = sum(int(np.prod(shape)) for _, shape in specs)
        first = params[specs[0][0]]
        flat = torch.empty(total, dtype=first.dtype, device=first.device)
        offsets, offset = {}, 0
        with torch.no_grad():
            for name, shape in specs:
                numel = int(np.prod(shape))
                view = flat[offset:offset + numel].view(params[name].shape)
                view.copy_(params[name].data)
                params[name].data = view  # the optimizer and DDP keep the Parameter object
                offsets[name] = offset
                offset += numel
        return flat, offsets

    def to_rollout(self) -> Dict[str, float]:
        """Training -> rollout layout, straight into the rollout engine's weights."""
        self.rollout.resume()
        return self.executor.to_rollout(into=self.rollout.weight_buffer()).metrics()

    def to_training(self) -> None:
        """Release the rollout weights and KV cache; the training weights were never moved."""
        self.executor.release()
        self.rollout.release()


# --------------------------------------------------------------------------- the worker
class ActorRolloutRefWorker(Worker):
    """``role``: "actor_rollout_ref" (with reference policy) or "actor_rollout"."""

    def __init__(self, config: Any, role: str = "actor_rollout_ref", total_training_steps: int = 1,
                 tokenizer: Any = None):
        from megatron.core import parallel_state as mpu

        from verl.workers.megatron.actor import MegatronActor
        from verl.workers.megatron.engine import MegatronEngine
        from verl.workers.rollout.base import SamplingParams
        from verl.workers.rollout.native.engine import NativeRollout

        if role not in ("actor_rollout_ref", "actor_rollout"):
            raise ValueError(f"role: expected 'actor_rollout_ref' or 'actor_rollout', found {role!r}")
        self.config = config
        arr = config.actor_rollout_ref
        self.actor_config, self.rollout_config = arr.actor, arr.rollout
        mega = arr.actor.megatron
        ensure_megatron(mega.tensor_model_parallel_size, mega.pipeline_model_parallel_size, mega.seed)
        self.model_config = ModelConfig.from_pretrained(arr.model.path)
        self.dp_size = mpu.get_data_parallel_world_size()

        engine = MegatronEngine(self.model_config, optim=optim_config(arr.actor.optim, total_training_steps,
                                                                      mega.use_distributed_optimizer))
        load_initial_weights(engine, arr.model.path, self.model_config, "lm")
        self.actor = MegatronActor(engine, micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu)
        self.ref = None
        if role == "actor_rollout_ref":
            ref_engine = MegatronEngine(self.model_config, optim=None)
            actor_params = dict(engine.module.named_parameters())
            with torch.no_grad():
                for name, param in ref_engine.module.named_parameters():
                    param.copy_(actor_params[name])
            self.ref = MegatronActor(ref_engine, micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu)

        training = TrainingLayout(tp=mega.tensor_model_parallel_size, pp=mega.pipeline_model_parallel_size,
                                  dp=self.dp_size)
        rollout_tp = arr.rollout.tensor_model_parallel_size
        groups = derive_groups(training, rollout_tp)
        tp_group = None
        for ranks in groups.rollout_tp_groups:  # every rank creates every group, in the same order
            group = dist.new_group(list(ranks)) if rollout_tp > 1 else None
            if dist.get_rank() in ranks:
                tp_group = group
        self.tokenizer = tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer is not None else 0
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        self.rollout = NativeRollout(self.model_config, tp_group=tp_group, dtype=DTYPES[arr.rollout.dtype],
                                     pad_token_id=pad_id)
        self.hybrid_engine = HybridEngine(engine, self.rollout, self.model_config, training, rollout_tp,
                                          config.hybrid_engine.bucket_bytes, arr.rollout.dtype)
        self.hybrid_engine.to_training()  # start with the rollout memory released
        rank = dist.get_rank()
        self.rollout_tp_rank = groups.rollout_tp_rank[rank]
        self.rollout_dp_rank = [i for i, g in enumerate(groups.rollout_tp_groups) if rank in g][0]
        self.rollout_dp_size = len(groups.rollout_tp_groups)
        common = dict(response_length=config.data.max_response_length, ignore_eos=arr.rollout.ignore_eos,
                      eos_token_id=() if self.eos_token_id is None else (self.eos_token_id,))
        self.train_sampling = SamplingParams(temperature=arr.rollout.temperature, top_p=arr.rollout.top_p,
                                             top_k=arr.rollout.top_k, do_sample=arr.rollout.do_sample,
                                             n=arr.rollout.n, **common)
        val = arr.rollout.val_kwargs
        self.val_sampling = SamplingParams(temperature=val.temperature, top_p=val.top_p, top_k=val.top_k,
                                           do_sample=val.do_sample, n=val.n, **common)

    def dispatch_meshes(self) -> Dict[str, MeshRank]:
        return {"megatron": megatron_mesh(),
                "rollout": MeshRank(self.rollout_dp_rank, self.rollout_dp_size, self.rollout_tp_rank == 0)}

    # ------------------------------------------------------------------ generation
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("rollout"))
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Prompts (input_ids/attention_mask [B, P]) -> verl rollout fields, n rows per prompt.

        meta_info: ``validate`` (True: val_kwargs sampling), ``seed`` (sampling seed of this call;
        each rollout replica offsets it by its DP rank so replicas draw different streams).
        """
        meta = dict(prompts.meta_info)
        params = self.val_sampling if meta.get("validate") else self.train_sampling
        if meta.get("seed") is not None:
            params = dataclasses.replace(params, seed=int(meta["seed"]) * 1009 + self.rollout_dp_rank)
        start = time.perf_counter()
        reshard = self.hybrid_engine.to_rollout()
        try:
            out = self.rollout.generate_sequences(prompts, params)
        finally:
            self.hybrid_engine.to_training()
        out.meta_info["metrics"] = {**reshard, "timing_s/generate_sequences": time.perf_counter() - start}
        return out

    # ------------------------------------------------------------------ log-probs
    @property
    def log_prob_temperature(self) -> float:
        """The temperature the training rollout sampled at (verl: ``rollout.temperature``); 1.0 when it
        is greedy, whose rollout log-probs are the raw log-softmax."""
        return 1.0 if self.train_sampling.greedy else float(self.train_sampling.temperature)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """old_log_probs [B, R] and entropys [B, R] under the current actor at the rollout temperature."""
        out = self.actor.compute_log_prob(batch_fields(data, ACTOR_FIELDS), calculate_entropy=True,
                                          temperature=self.log_prob_temperature)
        return DataProto.from_dict({"old_log_probs": out["log_probs"], "entropys": out["entropy"]})

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob [B, R] under the reference policy at the rollout temperature (as verl)."""
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob: expected role 'actor_rollout_ref', found no reference policy")
        out = self.ref.compute_log_prob(batch_fields(data, ACTOR_FIELDS), calculate_entropy=False,
                                        temperature=self.log_prob_temperature)
        return DataProto.from_dict({"ref_log_prob": out["log_probs"]})

    # ------------------------------------------------------------------ policy update
    def _policy_loss(self) -> Callable:
        cfg = self.actor_config

        def loss_fn(outputs: Dict[str, torch.Tensor], mb: Dict[str, torch.Tensor]):
            log_prob, mask = outputs["log_probs"], mb["response_mask"]
            pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = core_algos.compute_policy_loss(
                old_log_prob=mb["old_log_probs"], log_prob=log_prob, advantages=mb["advantages"],
                response_mask=mask, cliprange=cfg.clip_ratio, cliprange_low=cfg.clip_ratio_low,
                cliprange_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode)
            loss = pg_loss
            metrics = {"actor/pg_loss": pg_loss, "actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl,
                       "actor/pg_clipfrac_lower": pg_clipfrac_lower}
            if cfg.entropy_coeff != 0:
                entropy = core_algos.agg_loss(outputs["entropy"], mask, cfg.loss_agg_mode)
                loss = loss - cfg.entropy_coeff * entropy
                metrics["actor/entropy_loss"] = entropy
            if cfg.use_kl_loss:
                kld = core_algos.kl_penalty(log_prob, mb["ref_log_prob"], cfg.kl_loss_type)
                kl_loss = core_algos.agg_loss(kld, mask, cfg.loss_agg_mode)
                loss = loss + cfg.kl_loss_coef * kl_loss
                metrics["actor/kl_loss"] = kl_loss
                metrics["actor/kl_coef"] = torch.tensor(cfg.kl_loss_coef)
            return loss, metrics

        return loss_fn

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches (ppo_mini_batch_size prompts x n responses, split over DP).

        meta_info ``seed`` seeds the mini-batch shuffle. Returns meta_info["metrics"] averaged over
        the optimizer steps.
        """
        cfg = self.actor_config
        keys = ACTOR_FIELDS + ("response_mask", "old_log_probs", "advantages")
        if cfg.use_kl_loss:
            keys += ("ref_log_prob",)
        fields = batch_fields(data, keys)
        mini = cfg.ppo_mini_batch_size * self.rollout_config.n // self.dp_size
        self.actor.micro_batch_size = cfg.ppo_micro_batch_size_per_gpu
        steps = []
        try:
            for batch in ppo_mini_batches(fields, mini, cfg.ppo_epochs, cfg.shuffle, int(data.meta_info.get("seed", 0))):
                m = self.actor.update_policy(batch, self._policy_loss(), calculate_entropy=cfg.entropy_coeff != 0,
                                             temperature=self.log_prob_temperature)
                m = {k: v for k, v in m.items() if k.startswith("actor/")} | {
                    "actor/grad_norm": m["grad_norm"], "actor/lr": m["lr"]}
                steps.append(m)
        finally:
            self.actor.micro_batch_size = self.rollout_config.log_prob_micro_batch_size_per_gpu
        return DataProto(meta_info={"metrics": mean_metrics(steps)})

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Megatron model + optimizer; the iteration recorded is the optimizer's step count (Adam's t)."""
        from verl.workers.megatron.checkpoint import save_checkpoint

        save_checkpoint(self.actor.engine, path, int(self.actor.engine.scheduler.num_steps))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        from verl.workers.megatron.checkpoint import load_checkpoint

        return load_checkpoint(self.actor.engine, path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """The actor as an HF model directory at ``path`` (replaced atomically; see ``models/hf_export.py``)."""
        from verl.models.hf_export import export_actor_hf

        export_actor_hf(self.actor.engine, self.model_config, self.config.actor_rollout_ref.model.path, path,
                        self.tokenizer)
