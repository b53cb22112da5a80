"""Actor, rollout and reference policy on every rank. The rollout side (:mod:`verl.workers.rollout_side`) is
colocated, joined to the actor by the 3D-HybridEngine, or (``rollout.nnodes > 0``) a standalone pool
(:mod:`verl.workers.rollout_pool`) that this rank feeds with its part of the weights.

The actor trains in Megatron's (p, t, d) layout (or FSDP2's); a colocated rollout engine generates in the SGLang
layout (t_g, d_g·d). ``update_weights`` reshards the actor's weights into the rollout engine's flat buffer
in place (verl's weight-sync phase, timed by the trainer as ``timing_s/update_weights``);
``generate_sequences`` generates and releases the rollout memory, resharding first itself when no
``update_weights`` preceded it (validation). The training weights never move. The reference policy is a
forward-only copy of the initial actor (with LoRA: the actor with its adapters off).

Dispatch: log-prob and update methods split the batch over Megatron DP replicas
(MEGATRON_COMPUTE_PROTO); generation splits prompts over rollout DP replicas (mesh "rollout").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from verl.algorithms import core_algos
from verl.engine.base import EngineSpec
from verl.engine.lora import has_adapters
from verl.engine.registry import build_engine
from verl.engine.roles import Actor
from verl.engine.rollout.base import replica_params
from verl.models.config import ModelConfig
from verl.protocol import DataProto
from verl.single_controller import Dispatch, MeshRank, Worker, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils.logging_utils import get_logger
from verl.workers.config import ActorConfig, ActorRolloutRefConfig
from verl.workers.role_utils import (
    ACTOR_FIELDS,
    batch_fields,
    dp_mesh,
    global_batch_info,
    mean_metrics,
    ppo_mini_batches,
    token_budget,
)
from verl.workers.rollout_side import build_rollout_side

logger = get_logger(__name__)

# --------------------------------------------------------------------------- the policy loss
# Shares of the mini-batch loss (added over micro-batches); the other metrics are per-micro-batch means.
POLICY_LOSS_SHARES = ("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss")


class PolicyLossView:
    """What a registered policy loss reads as ``config``: the actor's keys (attribute or ``get`` access, as
    verl's ActorConfig) plus ``global_batch_info``, the mini-batch's global counts for :func:`agg_loss`."""

    def __init__(self, actor_config: ActorConfig, global_batch_info: dict[str, Any]):
        self._actor_config = actor_config
        self.global_batch_info = global_batch_info

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):  # not found on the object itself (copy, pickle): no delegation
            raise AttributeError(key)
        return getattr(self._actor_config, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.global_batch_info if key == "global_batch_info" else self._actor_config.get(key, default)


def policy_loss_fn(cfg: ActorConfig, counts: dict[str, int], on_policy: bool = False) -> Callable:
    """verl's PPO actor loss (pg_loss - entropy_coeff * entropy + kl_loss_coef * kl) for ``update_policy``
    with ``global_loss=True``: every term is aggregated with the mini-batch's global ``counts``
    (:func:`role_utils.global_batch_info`) and ``actor.loss_scale_factor``, as verl's ``global_batch_info``.
    The policy-gradient term is the registered loss ``actor.policy_loss.loss_mode``
    (:func:`core_algos.get_policy_loss_fn`: vanilla, gspo, or one a user registered). ``on_policy`` (one
    PPO epoch over one mini-batch, as verl's actor decides it): the old log-probs are the current ones,
    detached, so the ratio is exactly 1 and the old-log-prob input is not read."""
    info = dict(counts, loss_scale_factor=cfg.loss_scale_factor)
    policy_loss = core_algos.get_policy_loss_fn(cfg.policy_loss.loss_mode)
    loss_config = PolicyLossView(cfg, dict(counts))

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
        log_prob, mask = outputs["log_probs"], mb["response_mask"]
        old_log_prob = log_prob.detach() if on_policy else mb["old_log_probs"]
        # verl's rollout correction: importance weights on each token's loss (only when the batch has them, so a
        # user's registered loss without the argument keeps working).
        extra = {"rollout_is_weights": mb["rollout_is_weights"]} if "rollout_is_weights" in mb else {}
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = policy_loss(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=mb["advantages"], response_mask=mask,
            loss_agg_mode=cfg.loss_agg_mode, config=loss_config, **extra)
        loss = pg_loss
        metrics = {"actor/pg_loss": pg_loss, "actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl,
                   "actor/pg_clipfrac_lower": pg_clipfrac_lower}
        if cfg.entropy_coeff != 0:
            entropy = core_algos.agg_loss(outputs["entropy"], mask, cfg.loss_agg_mode, **info)
            loss = loss - cfg.entropy_coeff * entropy
            metrics["actor/entropy_loss"] = entropy
        if cfg.use_kl_loss:
            kld = core_algos.kl_penalty(log_prob, mb["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kld, mask, cfg.loss_agg_mode, **info)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss
            metrics["actor/kl_coef"] = torch.tensor(cfg.kl_loss_coef)
        return loss, metrics

    return loss_fn


class OldLogProbs:
    """The on-policy shortcut's old log-probs: what an update's only forward computed for each row (before its
    optimizer step, so exactly the old policy's), recorded by the loss function in the batch's row order."""

    def __init__(self, rows: int, width: int):
        self.log_probs = torch.zeros(rows, width)
        self.entropy = torch.zeros(rows, width)
        self.seen = torch.zeros(rows, dtype=torch.bool)

    def recording(self, loss_fn: Callable) -> Callable:
        def recorded(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
            rows = mb["row_index"].cpu()
            self.log_probs[rows] = outputs["log_probs"].detach().float().cpu()
            self.entropy[rows] = outputs["entropy"].detach().float().cpu()
            self.seen[rows] = True
            return loss_fn(outputs, mb)

        return recorded

    def fields(self) -> dict[str, torch.Tensor]:
        """``old_log_probs`` and ``entropys`` [B, R]; every row must have been seen (a forward per row)."""
        if not bool(self.seen.all()):
            raise RuntimeError(f"update_actor(return_old_log_probs): expected a forward over every row, found "
                               f"{int((~self.seen).sum())} of {self.seen.numel()} rows without one")
        return {"old_log_probs": self.log_probs, "entropys": self.entropy}


def _copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """The reference starts as the initial actor: copy each local parameter (same layout on both sides:
    Megatron shards, or FSDP DTensor shards on the same mesh)."""
    params = dict(source.named_parameters())
    with torch.no_grad():
        for name, param in target.named_parameters():
            src = params[name]
            dst = param.to_local() if hasattr(param, "to_local") else param
            dst.copy_(src.to_local() if hasattr(src, "to_local") else src)


# --------------------------------------------------------------------------- the worker
def _routing(data: DataProto) -> tuple[str, ...]:
    """The rollout's recorded experts travel with the actor's fields when it recorded them (routing replay)."""
    return ("routed_experts",) if "routed_experts" in data.batch.keys() else ()


class ActorRolloutRefWorker(Worker):
    """``role``: "actor_rollout_ref" (with reference policy) or "actor_rollout". Besides its section, from the
    rest of the config: ``seed`` (trainer.seed), ``bucket_bytes`` (the reshard's bucket), ``response_length``
    (data.max_response_length), ``max_seq_len`` (prompt + response) and ``max_batch_rows`` (the most responses
    one generation call makes: a training or a validation batch's)."""

    def __init__(self, config: ActorRolloutRefConfig, role: str = "actor_rollout_ref", total_training_steps: int = 1,
                 tokenizer: Any = None, *, seed: int, bucket_bytes: int, response_length: int, max_seq_len: int,
                 max_batch_rows: int):
        if role not in ("actor_rollout_ref", "actor_rollout"):
            raise ValueError(f"role: expected 'actor_rollout_ref' or 'actor_rollout', found {role!r}")
        self.config = arr = config  # the actor_rollout_ref section
        self.actor_config, self.rollout_config = arr.actor, arr.rollout
        self.strategy = arr.actor.strategy
        if arr.actor.policy_loss.loss_mode == "gspo" and arr.actor.loss_agg_mode != core_algos.GSPO_LOSS_AGG_MODE:
            logger.warning("actor.policy_loss.loss_mode=gspo aggregates the policy loss %s (GSPO's objective, as "
                           "verl) whatever actor.loss_agg_mode=%s says; the entropy and KL terms use %s",
                           core_algos.GSPO_LOSS_AGG_MODE, arr.actor.loss_agg_mode, arr.actor.loss_agg_mode)
        self.model_config = ModelConfig.from_pretrained(arr.model.path)
        self.log_prob_max_token_len = token_budget(arr.rollout, "log_prob_use_dynamic_bsz",
                                                   "log_prob_max_token_len_per_gpu")
        spec = EngineSpec(self.model_config, arr.model.path, "lm", arr.actor, arr.model, arr.actor.optim,
                          total_training_steps, seed=seed)
        engine = build_engine(self.strategy, spec)
        ref_engine = None
        # LoRA: the reference is the actor's own engine with its adapters off (verl's), no second copy.
        lora = has_adapters(engine.module)
        if role == "actor_rollout_ref" and not lora:  # built after the actor, whose layout it shares
            ref_engine = build_engine(self.strategy, dataclasses.replace(spec, role=arr.ref, optim=None,
                                                                         load_weights=False))
        training = engine.training_layout()
        # R3 routing replay: the actor's forward passes route by the rollout's recorded experts (the reference
        # policy routes on its own, as a fixed model should).
        engine.replay_routing = arr.actor.router_replay.mode == "R3"
        self.actor = Actor(engine, micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu,
                           max_token_len=self.log_prob_max_token_len)
        self.ref = None
        if role == "actor_rollout_ref" and lora:
            self.ref = Actor(engine, micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
                             max_token_len=token_budget(arr.ref, "log_prob_use_dynamic_bsz",
                                                        "log_prob_max_token_len_per_gpu"), adapters_off=True)
        if ref_engine is not None:  # the reference policy starts as the initial actor
            _copy_weights(engine.module, ref_engine.module)
            self.ref = Actor(ref_engine, micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
                             max_token_len=token_budget(arr.ref, "log_prob_use_dynamic_bsz",
                                                        "log_prob_max_token_len_per_gpu"))
        self.dp_size = engine.dp_size

        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        self._build_sampling(arr, response_length)
        self._seed = seed
        self._weights_version: int | None = None  # the asynchronous trainer's model version of those weights
        # Colocated (the 3D-HybridEngine into this rank's rollout engine) or a standalone pool (rollout.nnodes).
        offloaded = [engine] + ([ref_engine] if ref_engine is not None else [])
        self.rollout_side = build_rollout_side(engine, offloaded, self.model_config, training, arr, tokenizer,
                                               seed=seed, bucket_bytes=bucket_bytes, max_seq_len=max_seq_len,
                                               max_batch_rows=max_batch_rows)

    def _build_sampling(self, arr: ActorRolloutRefConfig, response_length: int) -> None:
        """The training and validation sampling parameters (a standalone pool receives them with each request)."""
        from verl.engine.rollout.base import SamplingParams

        common = dict(response_length=response_length, ignore_eos=arr.rollout.ignore_eos,
                      eos_token_id=() if self.eos_token_id is None else (self.eos_token_id,),
                      stop_token_ids=tuple(arr.rollout.stop_token_ids or ()))
        self.train_sampling = SamplingParams(temperature=arr.rollout.temperature, top_p=arr.rollout.top_p,
                                             top_k=arr.rollout.top_k, do_sample=arr.rollout.do_sample,
                                             n=arr.rollout.n, **common)
        val = arr.rollout.val_kwargs
        self.val_sampling = SamplingParams(temperature=val.temperature, top_p=val.top_p, top_k=val.top_k,
                                           do_sample=val.do_sample, n=val.n, **common)

    def shutdown(self) -> None:
        """Stop what outlives a step: the rollout engine this rank owns (an SGLang or vLLM engine; nothing for the
        native engine), or the standalone rollout pool (training rank 0 tells it to stop)."""
        self.rollout_side.close()

    def dispatch_meshes(self) -> dict[str, MeshRank]:
        side = self.rollout_side
        return {"megatron": dp_mesh(self.actor.engine), "rollout": MeshRank(side.dp_rank, side.dp_size,
                                                                            side.tp_rank == 0)}

    # ------------------------------------------------------------------ generation
    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def update_weights(self, version: int | None = None, force: bool = False) -> dict[str, float]:
        """Reshard the actor's weights into the rollout engine (training -> rollout layout) for the next
        ``generate_sequences``; returns rank 0's reshard statistics (``perf/reshard_bytes``,
        ``perf/reshard_peak_extra_mb``). A standalone pool is told the weights' ``version`` (the asynchronous
        trainer's global step; kept for later syncs when None); ``force`` sends even unchanged weights."""
        if version is not None:
            self._weights_version = version
        return self.rollout_side.sync_weights(self._weights_version, force)

    def _params(self, meta: dict, validate: bool = False) -> Any:
        """The sampling parameters of a generation call (training or ``val_kwargs``), seeded per replica."""
        params = self.val_sampling if validate else self.train_sampling
        return replica_params(params, meta.get("seed"), self.rollout_side.dp_rank)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("rollout"), generation=True)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Prompts (input_ids/attention_mask [B, P]) -> verl rollout fields, n rows per prompt; a colocated
        rollout's memory is released afterwards.

        meta_info: ``validate`` (True: val_kwargs sampling), ``seed`` (sampling seed of this call;
        each rollout replica offsets it by its DP rank so replicas draw different streams).
        """
        meta = dict(prompts.meta_info)
        return self.rollout_side.generate(prompts, self._params(meta, bool(meta.get("validate"))), meta.get("seed"),
                                          self._weights_version)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("rollout"), generation=True)
    def generate_segment(self, rows: DataProto) -> DataProto:
        """Partial rollout (verl's V1 asynchronous modes, colocated): continue each row -- a trajectory's prompt
        and the tokens it already has, left-padded -- for at most ``limits`` more tokens, n=1 each, and stop once
        this replica's share of whole groups finished (meta ``need_fraction`` of its groups, rounded up; tensor
        ``group``), no ``required`` row is running, or every row finished. Returns the new tokens
        (``responses``, ``response_mask``, ``rollout_log_probs``), ``width`` (meta) columns wide; the rollout
        memory is released afterwards. See :mod:`verl.engine.rollout.partial`."""
        return self.rollout_side.generate_segment(rows, self._params(dict(rows.meta_info)), self._weights_version)

    # ------------------------------------------------------------------ agent loops across steps
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agent_open(self, groups: list[dict], version: int) -> dict[str, float]:
        """``rollout.multi_turn`` under colocate_async: a generation phase on the weights of ``version`` (resharded
        into the rollout first when they are not there yet). ``groups``: the prompt groups to start, each
        ``{uid, n, replica, row}``; this rank's replica starts those with its ``replica`` and lets its held
        turns go on. See :mod:`verl.workers.agent_stream`."""
        return self.rollout_side.agent_open(groups, version, self._params({"seed": self._seed}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agent_poll(self, wait_s: float) -> list:
        """This replica's trajectories finished since the last poll (waiting up to ``wait_s`` for one)."""
        return self.rollout_side.agent_poll(wait_s)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agent_pause(self) -> dict[str, float]:
        """End the phase: the engine stops after its decode step (the cut turns wait for the next phase) and the
        rollout memory is released for training."""
        return self.rollout_side.agent_pause()

    # ------------------------------------------------------------------ log-probs
    @property
    def log_prob_temperature(self) -> float:
        """The temperature the training rollout sampled at (verl: ``rollout.temperature``); 1.0 when it
        is greedy, whose rollout log-probs are the raw log-softmax."""
        return 1.0 if self.train_sampling.greedy else float(self.train_sampling.temperature)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def snapshot_old_policy(self) -> None:
        """Keep a host copy of the actor's weights as the old policy of the updates that follow (verl's
        separate_async keeps pi_old fixed over the mini-batch updates of one weight sync)."""
        with torch.no_grad():
            self._old_policy = [p.detach().to("cpu", copy=True) for p in self._actor_params()]

    def _actor_params(self) -> list[torch.Tensor]:
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.actor.engine.module.parameters()]

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, reads=ACTOR_FIELDS + ("routed_experts",))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """old_log_probs [B, R] and entropys [B, R] under the current actor at the rollout temperature; under
        the snapshot of :meth:`snapshot_old_policy` instead when meta_info ``old_policy`` is set."""
        params = self._actor_params() if data.meta_info.get("old_policy") else None
        current = None
        try:
            if params is not None:
                if getattr(self, "_old_policy", None) is None:
                    raise RuntimeError("compute_log_prob(old_policy): expected snapshot_old_policy() first, found none")
                with torch.no_grad():
                    current = [p.detach().clone() for p in params]
                    for p, old in zip(params, self._old_policy, strict=True):
                        p.copy_(old)
            out = self.actor.compute_log_prob(batch_fields(data, ACTOR_FIELDS + _routing(data)),
                                              calculate_entropy=True, temperature=self.log_prob_temperature)
        finally:
            if current is not None:
                with torch.no_grad():
                    for p, now in zip(params, current, strict=True):
                        p.copy_(now)
        return DataProto.from_dict({"old_log_probs": out["log_probs"], "entropys": out["entropy"]})

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, reads=ACTOR_FIELDS)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob [B, R] under the reference policy at the rollout temperature (as verl)."""
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob: expected role 'actor_rollout_ref', found no reference policy")
        out = self.ref.compute_log_prob(batch_fields(data, ACTOR_FIELDS), calculate_entropy=False,
                                        temperature=self.log_prob_temperature)
        return DataProto.from_dict({"ref_log_prob": out["log_probs"]})

    # ------------------------------------------------------------------ policy update
    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO,
              reads=ACTOR_FIELDS + ("response_mask", "old_log_probs", "advantages", "ref_log_prob",
                                    "rollout_is_weights", "routed_experts"))
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches (ppo_mini_batch_size prompts x n responses, split over DP).

        meta_info ``seed`` seeds the mini-batch shuffle. Returns meta_info["metrics"] averaged over
        the optimizer steps.
        """
        cfg = self.actor_config
        # The trainer's on-policy shortcut: no old log-probs came in; this update's forward returns them.
        keep = bool(data.meta_info.get("return_old_log_probs"))
        keys = ACTOR_FIELDS + ("response_mask", "advantages") + _routing(data) + (() if keep else ("old_log_probs",))
        if cfg.use_kl_loss:
            keys += ("ref_log_prob",)
        if "rollout_is_weights" in data.batch.keys():
            keys += ("rollout_is_weights",)
        fields = batch_fields(data, keys)
        mini = cfg.ppo_mini_batch_size * self.rollout_config.n // self.dp_size
        self.actor.micro_batch_size = cfg.ppo_micro_batch_size_per_gpu
        self.actor.max_token_len = token_budget(cfg, "use_dynamic_bsz", "ppo_max_token_len_per_gpu")
        if self.rollout_side.synced:  # weights synced before this update would be stale
            self.rollout_side.release()
        steps = []
        # One epoch over one mini-batch whose old log-probs are this actor's: the ratio is exactly 1 (not when
        # they came from an older snapshot, meta_info ``old_policy``).
        rows = fields["response_mask"].size(0)
        on_policy = cfg.ppo_epochs == 1 and mini >= rows and not data.meta_info.get("old_policy")
        kept = None
        if keep:
            if not on_policy:
                raise RuntimeError(f"update_actor(return_old_log_probs): expected one epoch over one mini-batch, found "
                                   f"ppo_epochs={cfg.ppo_epochs} and {rows} rows over mini-batches of {mini}")
            fields["row_index"] = torch.arange(rows)
            kept = OldLogProbs(rows, fields["response_mask"].size(1))
        try:
            seed = int(data.meta_info.get("seed", 0))
            for batch in ppo_mini_batches(fields, mini, cfg.ppo_epochs, cfg.shuffle, seed):
                counts = global_batch_info(batch["response_mask"], self.actor.engine.dp_group)
                loss_fn = policy_loss_fn(cfg, counts, on_policy)
                if kept is not None:
                    loss_fn = kept.recording(loss_fn)
                m = self.actor.update_policy(batch, loss_fn, calculate_entropy=cfg.entropy_coeff != 0 or keep,
                                             temperature=self.log_prob_temperature, global_loss=True,
                                             summed_metrics=POLICY_LOSS_SHARES)
                m = {k: v for k, v in m.items() if k.startswith("actor/")} | {
                    "actor/grad_norm": m["grad_norm"], "actor/lr": m["lr"]}
                steps.append(m)
        finally:
            self.actor.micro_batch_size = self.rollout_config.log_prob_micro_batch_size_per_gpu
            self.actor.max_token_len = self.log_prob_max_token_len
        if kept is not None and self.actor.engine.is_output_rank:  # the ranks whose forward ends in log-probs
            return DataProto.from_dict(kept.fields(), meta_info={"metrics": mean_metrics(steps)})
        return DataProto(meta_info={"metrics": mean_metrics(steps)})

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Model + optimizer (Megatron dist_checkpointing or FSDP's DCP); the iteration recorded is the
        optimizer's step count (Adam's t). RNG states are the trainer's (rng/rank<r>.pt)."""
        self.actor.engine.save_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        if self.rollout_side.synced:
            self.rollout_side.release()
        return self.actor.engine.load_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """The actor as an HF model directory at ``path`` (replaced atomically; see ``models/hf_export.py``)."""
        self.actor.engine.export_hf(self.config.model.path, path, self.tokenizer)
