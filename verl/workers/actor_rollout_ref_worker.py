"""Actor, rollout and reference policy colocated on every rank, joined by the 3D-HybridEngine (or, with
``rollout.nnodes > 0``, actor and reference here and the rollout in a standalone pool: :mod:`rollout_pool`).

The actor trains in Megatron's (p, t, d) layout; the rollout engine generates in the SGLang layout
(t_g, d_g·d). ``update_weights`` reshards the actor's weights into the rollout engine's flat buffer
in place (``to_rollout``; verl's weight-sync phase, timed by the trainer as ``timing_s/update_weights``);
``generate_sequences`` generates and releases the rollout memory (``to_training``), resharding first
itself when no ``update_weights`` preceded it (validation). The training weights never move. The
reference policy is a forward-only copy of the initial actor.

Dispatch: log-prob and update methods split the batch over Megatron DP replicas
(MEGATRON_COMPUTE_PROTO); generation splits prompts over rollout DP replicas (mesh "rollout").
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from verl.algorithms import core_algos
from verl.engine.base import EngineSpec
from verl.engine.lora import has_adapters
from verl.engine.registry import build_engine
from verl.engine.roles import Actor
from verl.engine.rollout import registry as rollout_registry
from verl.hybrid_engine.groups import derive_groups
from verl.hybrid_engine.hybrid_engine import HybridEngine, rollout_tp_process_group
from verl.hybrid_engine.weight_sync import METRIC_BYTES as METRIC_SYNC_BYTES
from verl.hybrid_engine.weight_sync import METRIC_DELTA_FRACTION
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

logger = get_logger(__name__)

# --------------------------------------------------------------------------- the policy loss
# Shares of the mini-batch loss (added over micro-batches); the other metrics are per-micro-batch means.
POLICY_LOSS_SHARES = ("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss")


class PolicyLossConfig:
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
    loss_config = PolicyLossConfig(cfg, dict(counts))

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
        self._rollout_synced = False  # the rollout engine holds the actor's current weights
        self._agent_batch = None  # rollout.multi_turn.enable: the agent loops of a generation call, built on first use
        self._agent_stream = None  # ... under colocate_async: the loops that live across steps (agent_open)
        self._seed = seed
        self._weights_version: int | None = None  # the asynchronous trainer's model version of those weights
        self.pool = None
        if arr.rollout.nnodes:  # a standalone rollout pool: this rank only sends weights and (rank 0) prompts
            from verl.workers.rollout_pool import RolloutPoolLink

            self.pool = RolloutPoolLink(engine, self.model_config, training, arr.rollout, bucket_bytes)
            self.rollout = self.hybrid_engine = None
            self.rollout_dp_rank, self.rollout_dp_size = 0, 1
            self.rollout_tp_rank = 0 if dist.get_rank() == 0 else 1  # rank 0 collects the pool's rollouts
            return
        rollout_tp = arr.rollout.tensor_model_parallel_size
        groups = derive_groups(training, rollout_tp)
        rank = dist.get_rank()
        rollout_engine = rollout_registry.rollout_engine(arr.rollout.name)
        self.rollout_dp_rank, my_group_ranks, tp_group = rollout_tp_process_group(
            groups, rank, backend=rollout_engine.capabilities.group_backend)
        self.rollout_tp_rank = groups.rollout_tp_rank[rank]
        self.rollout_dp_size = len(groups.rollout_tp_groups)
        # Rows one engine generates at once: its replica's share of a training or a validation batch.
        self.rollout = rollout_engine.build(arr.rollout, rollout_registry.RolloutSite(
            self.model_config, arr.model.path, tp_group, tuple(my_group_ranks), self.rollout_dp_rank,
            pad_token_id=tokenizer.pad_token_id if tokenizer is not None else 0, seed=seed, bucket_bytes=bucket_bytes,
            max_rows=-(-max_batch_rows // self.rollout_dp_size), max_seq_len=max_seq_len))
        self.hybrid_engine = HybridEngine(engine, self.rollout, self.model_config, training, rollout_tp,
                                          bucket_bytes, arr.rollout.dtype)
        self.hybrid_engine.to_training()  # start with the rollout memory released

    def _build_sampling(self, arr: ActorRolloutRefConfig, response_length: int) -> None:
        """The training and validation sampling parameters (a standalone pool receives them with each request)."""
        from verl.engine.rollout.base import SamplingParams

        common = dict(response_length=response_length, ignore_eos=arr.rollout.ignore_eos,
                      eos_token_id=() if self.eos_token_id is None else (self.eos_token_id,))
        self.train_sampling = SamplingParams(temperature=arr.rollout.temperature, top_p=arr.rollout.top_p,
                                             top_k=arr.rollout.top_k, do_sample=arr.rollout.do_sample,
                                             n=arr.rollout.n, **common)
        val = arr.rollout.val_kwargs
        self.val_sampling = SamplingParams(temperature=val.temperature, top_p=val.top_p, top_k=val.top_k,
                                           do_sample=val.do_sample, n=val.n, **common)

    def shutdown(self) -> None:
        """Stop what outlives a step: the SGLang engine this rank owns (nothing for the native engine), or the
        standalone rollout pool (training rank 0 tells it to stop)."""
        if self.pool is not None:
            self.pool.close()
        if self._agent_stream is not None:
            self._agent_stream.close()
            self._agent_stream = None
        if self.rollout is not None:
            self.rollout.shutdown()

    def dispatch_meshes(self) -> dict[str, MeshRank]:
        return {"megatron": dp_mesh(self.actor.engine),
                "rollout": MeshRank(self.rollout_dp_rank, self.rollout_dp_size, self.rollout_tp_rank == 0)}

    # ------------------------------------------------------------------ generation
    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def update_weights(self, version: int | None = None, force: bool = False) -> dict[str, float]:
        """Reshard the actor's weights into the rollout engine (training -> rollout layout) for the next
        ``generate_sequences``; returns rank 0's reshard statistics (``perf/reshard_bytes``,
        ``perf/reshard_peak_extra_mb``). A standalone pool is told the weights' ``version`` (the asynchronous
        trainer's global step; kept for later syncs when None); ``force`` sends even unchanged weights."""
        if version is not None:
            self._weights_version = version
        if self.pool is not None:
            if self._rollout_synced and not force:  # the pool kept the current weights since the last sync
                return {METRIC_SYNC_BYTES: 0.0, METRIC_DELTA_FRACTION: 0.0}
            metrics = self.pool.sync_weights(self._weights_version)
        else:
            metrics = self.hybrid_engine.to_rollout()
        self._rollout_synced = True
        return metrics

    def _release_rollout(self) -> None:
        """Free the rollout weights and KV cache; the next generation reshards again (a standalone pool keeps
        its memory: its weights are only stale now)."""
        if self.hybrid_engine is not None:
            self.hybrid_engine.to_training()
        self._rollout_synced = False

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("rollout"), generation=True)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Prompts (input_ids/attention_mask [B, P]) -> verl rollout fields, n rows per prompt; the
        rollout memory is released afterwards.

        meta_info: ``validate`` (True: val_kwargs sampling), ``seed`` (sampling seed of this call;
        each rollout replica offsets it by its DP rank so replicas draw different streams).
        """
        meta = dict(prompts.meta_info)
        params = self.val_sampling if meta.get("validate") else self.train_sampling
        if meta.get("seed") is not None:
            params = dataclasses.replace(params, seed=int(meta["seed"]) * 1009 + self.rollout_dp_rank)
        if self.pool is not None:
            metrics = {} if self._rollout_synced else self.update_weights()
            if dist.get_rank() != 0:
                return None
            out = self.pool.generate(prompts, params, meta.get("seed"))
            out.meta_info["metrics"] = {**metrics, **out.meta_info["metrics"]}
            return out
        metrics = {} if self._rollout_synced else self.hybrid_engine.to_rollout()
        start = time.perf_counter()
        engines = [self.actor.engine] + ([self.ref.engine] if self.ref is not None
                                         and self.ref.engine is not self.actor.engine else [])
        try:
            # While the rollout generates, the state the config's *_offload keys name waits in host memory.
            offloaded = sum(engine.offload_idle_state() for engine in engines)
            if offloaded:
                metrics = {**metrics, "perf/offloaded_mb": offloaded / 2**20}
            if self.rollout_config.multi_turn.enable:
                out = self._generate_agent_loops(prompts, params)
            else:
                out = self.rollout.generate_sequences(prompts, params)
        finally:
            for engine in engines:
                engine.onload()
            self._release_rollout()
        if out is None:  # an SGLang group's other ranks: the owner returns the group's rollout
            return None
        out.meta_info["metrics"] = {**metrics, **out.meta_info.get("metrics", {}),  # the agent loops' own
                                    "timing_s/generate_sequences": time.perf_counter() - start}
        return out

    def _generate_agent_loops(self, prompts: DataProto, params) -> DataProto | None:
        """``rollout.multi_turn.enable``: this replica's agent loops over the batch
        (:mod:`verl.workers.agent_batch`)."""
        from verl.workers.agent_batch import AgentBatch

        if self._agent_batch is None:  # tools and custom loops are loaded once per worker
            self._agent_batch = AgentBatch(self.config, self.tokenizer)
        return self._agent_batch.generate(self.rollout, prompts, params, self.rollout_tp_rank,
                                          self.rollout_config.prompt_length)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("rollout"), generation=True)
    def generate_segment(self, rows: DataProto) -> DataProto:
        """Partial rollout (verl's V1 asynchronous modes, colocated): continue each row -- a trajectory's prompt
        and the tokens it already has, left-padded -- for at most ``limits`` more tokens, n=1 each, and stop once
        this replica's share of whole groups finished (meta ``need_fraction`` of its groups, rounded up; tensor
        ``group``), no ``required`` row is running, or every row finished. Returns the new tokens
        (``responses``, ``response_mask``, ``rollout_log_probs``), ``width`` (meta) columns wide; the rollout
        memory is released afterwards. See :mod:`verl.engine.rollout.partial`."""
        from verl.engine.rollout.partial import generate_segment

        if self.pool is not None:
            raise RuntimeError("generate_segment: expected a colocated rollout, found a standalone pool")
        meta = dict(rows.meta_info)
        params = self.train_sampling
        if meta.get("seed") is not None:
            params = dataclasses.replace(params, seed=int(meta["seed"]) * 1009 + self.rollout_dp_rank)
        inputs = {k: rows.batch[k] for k in ("input_ids", "attention_mask", "limits", "group", "required")}
        local_groups = int(inputs["group"].unique().numel())
        min_groups = -(-local_groups * int(meta["need"]) // int(meta["total_groups"]))
        metrics = {} if self._rollout_synced else self.hybrid_engine.to_rollout()
        start = time.perf_counter()
        try:
            responses, mask, log_probs = generate_segment(self.rollout, inputs, params, self.rollout.pad_token_id,
                                                          min_groups)
        finally:
            self._release_rollout()
        if self.rollout_tp_rank != 0:
            return None
        width = int(meta["width"])
        pad = width - responses.shape[1]
        out = DataProto.from_dict({
            "responses": torch.nn.functional.pad(responses, (0, pad), value=self.rollout.pad_token_id),
            "response_mask": torch.nn.functional.pad(mask.to(torch.int64), (0, pad)),
            "rollout_log_probs": torch.nn.functional.pad(log_probs, (0, pad))})
        out.meta_info["metrics"] = {**metrics, "timing_s/generate_sequences": time.perf_counter() - start}
        return out

    # ------------------------------------------------------------------ agent loops across steps
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agent_open(self, groups: list[dict], version: int) -> dict[str, float]:
        """``rollout.multi_turn`` under colocate_async: a generation phase on the weights of ``version`` (resharded
        into the rollout first when they are not there yet). ``groups``: the prompt groups to start, each
        ``{uid, n, replica, row}``; this rank's replica starts those with its ``replica`` and lets its held
        turns go on. See :mod:`verl.workers.agent_stream`."""
        from verl.workers.agent_stream import AgentFollower, AgentStream

        metrics = {} if self._rollout_synced else self.hybrid_engine.to_rollout()
        self._rollout_synced = True
        if self._agent_stream is None:
            params = dataclasses.replace(self.train_sampling, seed=self._seed * 1009 + self.rollout_dp_rank)
            server = self.rollout.token_server(params, self.rollout.pad_token_id)
            if self.rollout_tp_rank != 0:  # rollout TP > 1: the replica's rank 0 runs the loops, this rank follows
                self._agent_stream = AgentFollower(server)
            else:
                self._agent_stream = AgentStream.over(server, self.config, self.tokenizer, params)
        self._agent_stream.open(version, [g for g in groups if g["replica"] == self.rollout_dp_rank])
        return metrics

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agent_poll(self, wait_s: float) -> list:
        """This replica's trajectories finished since the last poll (waiting up to ``wait_s`` for one)."""
        return self._agent_stream.poll(wait_s)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agent_pause(self) -> dict[str, float]:
        """End the phase: the engine stops after its decode step (the cut turns wait for the next phase) and the
        rollout memory is released for training."""
        metrics = self._agent_stream.pause() if self._agent_stream is not None else \
            {"agent_loop/engine_calls": 0.0, "agent_loop/interrupted_turns": 0.0, "agent_loop/held_turns": 0.0}
        self._release_rollout()
        return metrics

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
        keys = ACTOR_FIELDS + ("response_mask", "old_log_probs", "advantages") + _routing(data)
        if cfg.use_kl_loss:
            keys += ("ref_log_prob",)
        if "rollout_is_weights" in data.batch.keys():
            keys += ("rollout_is_weights",)
        fields = batch_fields(data, keys)
        mini = cfg.ppo_mini_batch_size * self.rollout_config.n // self.dp_size
        self.actor.micro_batch_size = cfg.ppo_micro_batch_size_per_gpu
        self.actor.max_token_len = token_budget(cfg, "use_dynamic_bsz", "ppo_max_token_len_per_gpu")
        if self._rollout_synced:  # weights synced before this update would be stale
            self._release_rollout()
        steps = []
        # One epoch over one mini-batch whose old log-probs are this actor's: the ratio is exactly 1 (not when
        # they came from an older snapshot, meta_info ``old_policy``).
        on_policy = (cfg.ppo_epochs == 1 and mini >= fields["response_mask"].size(0)
                     and not data.meta_info.get("old_policy"))
        try:
            seed = int(data.meta_info.get("seed", 0))
            for batch in ppo_mini_batches(fields, mini, cfg.ppo_epochs, cfg.shuffle, seed):
                counts = global_batch_info(batch["response_mask"], self.actor.engine.dp_group)
                loss_fn = policy_loss_fn(cfg, counts, on_policy)
                m = self.actor.update_policy(batch, loss_fn, calculate_entropy=cfg.entropy_coeff != 0,
                                             temperature=self.log_prob_temperature, global_loss=True,
                                             summed_metrics=POLICY_LOSS_SHARES)
                m = {k: v for k, v in m.items() if k.startswith("actor/")} | {
                    "actor/grad_norm": m["grad_norm"], "actor/lr": m["lr"]}
                steps.append(m)
        finally:
            self.actor.micro_batch_size = self.rollout_config.log_prob_micro_batch_size_per_gpu
            self.actor.max_token_len = self.log_prob_max_token_len
        return DataProto(meta_info={"metrics": mean_metrics(steps)})

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Model + optimizer (Megatron dist_checkpointing or FSDP's DCP); the iteration recorded is the
        optimizer's step count (Adam's t). RNG states are the trainer's (rng/rank<r>.pt)."""
        self.actor.engine.save_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        if self._rollout_synced:
            self._release_rollout()
        return self.actor.engine.load_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """The actor as an HF model directory at ``path`` (replaced atomically; see ``models/hf_export.py``)."""
        self.actor.engine.export_hf(self.config.model.path, path, self.tokenizer)
