"""One megatron-core model on this rank's TP/PP/DP groups (the ``megatron`` strategy's
:class:`~verl.engine.base.TrainingEngine`): forward(-backward) over micro-batches, DDP, optimizer, LR schedule,
dist_checkpointing checkpoints, HF export. Roles (actor, critic, reward model) plug in two callables:

  output_fn(output, aligned_ids, shifts, micro_batch) -> {name: tensor}
      turns the last stage's model output ([b, S, V/tp] logits or [b, S, 1] values, rows left-aligned
      by ``verl.engine.padding.left_align``) into per-sample results (log-probs, entropy, values, ...);
  loss_fn(outputs, micro_batch) -> (loss, {metric: scalar tensor})
      the policy / value loss hook (PPO, GRPO, ...), called on the last stage during training:
      by default the micro-batch's own mean loss (averaged over micro-batches and DP); with
      ``train_step(global_loss=True)`` its share of the step's loss, normalised by counts over the
      whole mini-batch on every DP rank and scaled by the DP size (verl's ``agg_loss`` with
      ``dp_size``, ``batch_num_tokens``, ``global_batch_size``), so that the gradient is the same
      whatever the DP size and micro-batch split.

Micro-batches: ``micro_batch_size`` rows each, or with ``max_token_len`` (verl's ``use_dynamic_bsz``) as many
rows as fit that many valid tokens (:func:`token_budget_groups`; pipeline parallelism needs equal shapes,
so only with pp = 1); rows keep the padded sequence length either way.

Batches are plain dicts of tensors that share the batch dimension (input_ids, attention_mask,
position_ids, responses, ...). Every rank of a model-parallel group passes the same batch; each DP
rank passes its own share. Results are returned on every rank of the pipeline.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist

from verl.engine.base import Batch, BoundBuffer, EngineSpec, LossFn, OptimConfig, OutputFn, TrainingEngine, optim_config
from verl.engine.lora import LoRASettings, lora_export_options, lora_settings, model_key, value_head
from verl.engine.megatron.config_rules import RULES
from verl.engine.megatron.padding import attention_mask_4d
from verl.engine.megatron.parallel import ensure_megatron
from verl.engine.micro_batches import split_micro_batches, token_budget_groups
from verl.engine.padding import left_align
from verl.errors import InputError
from verl.models.config import ModelConfig
from verl.models.mcore.model import build_gpt_model
from verl.utils.device import get_device, to_device


class MegatronEngine(TrainingEngine):
    def __init__(self, config: ModelConfig, head: str = "lm", optim: OptimConfig | None = None, *,
                 params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                 transformer_overrides: Mapping[str, Any] | None = None, lora: LoRASettings | None = None,
                 lora_seed: int = 0):
        from megatron.core import parallel_state as mpu

        self.config = config
        self.head = head
        self.optim_config = optim
        # transformer_overrides: verl's megatron.override_transformer_config (e.g. activation recompute).
        module = build_gpt_model(config, head, params_dtype=params_dtype, sequence_parallel=sequence_parallel,
                                 **dict(transformer_overrides or {}))
        self.tf_config = module.config
        # LoRA (verl.engine.lora): the base frozen before DDP and the optimizer see it, so both hold adapters only.
        self.lora = lora
        # trainer-side choices for a LoRA actor's checkpoints and export (from_spec reads them from the config)
        self.save_lora_only, self.export_merged = False, False
        # the HF checkpoint under the adapters (load_hf_weights), which a LoRA-only checkpoint records
        self.base_model_path: str | None = None
        self.base_fingerprint: str | None = None
        if lora is not None:
            from verl.engine.megatron.lora import apply_lora

            apply_lora(module, config, lora, seed=lora_seed, keep=value_head(head, RULES))
        self.optimizer = None
        self.scheduler = None
        if optim is None:
            self.model = module
        else:
            self.model, self.optimizer, self.scheduler = self._wrap_for_training(module, optim, params_dtype)
        self.is_last_stage = mpu.is_pipeline_last_stage()
        # Response-only logits: the output layer runs on the positions an output_fn with ``response_fn`` reads
        # ([b, R] left-aligned columns, set per micro-batch around the model's call), not on every column.
        self._logit_positions: torch.Tensor | None = None
        if head == "lm" and self.is_last_stage and getattr(module, "output_layer", None) is not None:
            module.output_layer.register_forward_pre_hook(self._gather_logit_positions, with_kwargs=True)
        # Routing replay (verl's actor.router_replay.mode=R3): forward passes route each token to the experts a
        # batch's ``routed_experts`` recorded (the rollout's choice) instead of this model's own top k.
        self.replay_routing = False
        routers = [m for m in module.modules() if getattr(m, "router_replay", None) is not None]
        self._routers = [m.router_replay for m in routers]
        # Router statistics of a training step: tokens routed to each expert, per MoE layer of this stage.
        self._expert_counts: torch.Tensor | None = None
        for index, router in enumerate(routers):
            router.register_forward_hook(functools.partial(self._count_routed_tokens, index))
        per_stage = config.num_hidden_layers // mpu.get_pipeline_model_parallel_world_size()
        first = mpu.get_pipeline_model_parallel_rank() * per_stage
        # This stage's MoE layers as positions along routed_experts' layer axis (the model's MoE layers).
        self._stage_moe_layers = [i for i, layer in enumerate(config.moe_layers) if first <= layer < first + per_stage]
        if len(self._stage_moe_layers) != len(self._routers):
            raise RuntimeError(f"routing replay: expected one router per MoE layer of this stage "
                               f"({len(self._stage_moe_layers)}), found {len(self._routers)}")

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> MegatronEngine:
        """From the role's ``megatron`` section (its layout must be the process's: one parallel state, which
        ``spec.layout_role``'s section sets up on first use) and ``optim``; the HF weights unless the caller
        sets them. ``spec.model``'s activation recompute only for an engine that trains (it saves backward
        memory)."""
        layout = (spec.layout_role or spec.role).megatron
        ensure_megatron(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.seed,
                        getattr(layout, "expert_model_parallel_size", 1),
                        getattr(layout, "expert_tensor_parallel_size", None))
        mega = spec.role.megatron
        optim = None if spec.optim is None else optim_config(spec.optim, spec.total_training_steps,
                                                              mega.use_distributed_optimizer)
        lora = lora_settings(spec.model, RULES, model_key(spec.head))
        engine = cls(spec.model_config, spec.head, optim,
                     **engine_options(mega, spec.model if optim is not None else None), lora=lora,
                     lora_seed=spec.seed)
        if spec.load_weights:
            engine.load_hf_weights(spec.model_path)
        if lora is not None and lora.adapter_path:
            engine.load_adapter(lora.adapter_path, spec.model_path)
        engine.save_lora_only, engine.export_merged = lora_export_options(spec)
        engine.idle_offload = {"params": bool(mega.get("param_offload")), "grads": bool(mega.get("grad_offload")),
                               "optimizer": bool(mega.get("optimizer_offload"))}
        return engine

    def load_hf_weights(self, model_path: str) -> None:
        """An HF directory's safetensors into the model; a bare config.json keeps Megatron's seeded init."""
        from verl.models.hf_io import HFCheckpoint
        from verl.models.mcore.weights import load_hf_into_model
        from verl.models.spec.registry import model_spec

        if not os.path.isdir(model_path):
            return
        if self.lora is not None:
            from verl.engine.lora import base_fingerprint

            self.base_model_path, self.base_fingerprint = model_path, base_fingerprint(model_path)
        checkpoint = HFCheckpoint(model_path)
        score_head = model_spec(self.config.model_type).score_head.bind(self.config)

        def get_hf(name: str) -> torch.Tensor:
            if self.head == "value" and name in score_head.hf and name not in checkpoint:
                # A critic built from an LM checkpoint: its value head starts at zero.
                return torch.zeros(score_head.shapes[score_head.hf.index(name)])
            return checkpoint.get(name)

        if self.lora is not None:  # the base's tensors only; the adapters keep their own values
            load_hf_into_model(_BaseView(self.module), self.config, get_hf, self.head, names=checkpoint.files)
            return
        load_hf_into_model(self.module, self.config, get_hf, self.head, names=checkpoint.files)

    def load_adapter(self, adapter_dir: str, model_path: str) -> None:
        """A PEFT adapter directory (``lora.adapter_path``) into this rank's adapter shards, checked against the
        model first (:func:`verl.engine.lora.peft_io.read_adapter`)."""
        from verl.engine.lora.peft_io import read_adapter
        from verl.engine.megatron.lora import load_full_adapters

        tensors = read_adapter(adapter_dir, self.lora, model_path)
        load_full_adapters(self.module, self.config, lambda name: tensors[name])

    def swap_hf_weights(self, spec: EngineSpec) -> MegatronEngine:
        """In place when the architecture is the same (no optimizer state to lose), else a new engine."""
        if spec.model_config != self.config:
            return super().swap_hf_weights(spec)
        self.load_hf_weights(spec.model_path)
        return self

    def _wrap_for_training(self, module, optim: OptimConfig, params_dtype: torch.dtype):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=optim.use_distributed_optimizer)
        model = DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=module)
        # Sums tied-embedding and sequence-parallel grads and all-reduces over DP after backward.
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], clip_grad=optim.clip_grad,
            bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16, params_dtype=params_dtype,
            use_distributed_optimizer=optim.use_distributed_optimizer), [model])
        _use_fused_adam_on_cpu(optimizer)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=optim.lr_warmup_init if optim.lr_warmup_steps else optim.lr, max_lr=optim.lr,
            min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=max(optim.lr_decay_steps or optim.total_training_steps, optim.lr_warmup_steps + 1),
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=optim.total_training_steps, wd_incr_style="constant")
        return model, optimizer, scheduler

    def token_log_probs(self, compute_entropy: bool, temperature: float = 1.0) -> OutputFn:
        """output_fn: response log-probs (and entropy) from this engine's vocab-parallel logits."""
        from verl.engine.megatron.actor import token_log_probs

        return token_log_probs(self, compute_entropy, temperature)

    def _gather_logit_positions(self, _module, args, kwargs):
        """forward pre-hook of the output layer: its hidden states [s, b, h] cut to ``_logit_positions`` [b, R]
        -> [R, b, h] (GPTModel then returns [b, R, V/tp] logits)."""
        positions = self._logit_positions
        if positions is None:
            return None
        hidden = args[0]
        index = positions.t().unsqueeze(-1).expand(-1, -1, hidden.size(-1))
        return (hidden.gather(0, index), *args[1:]), kwargs

    def _response_positions(self, micro_batch: dict[str, torch.Tensor], shifts: torch.Tensor,
                            keep: int) -> torch.Tensor | None:
        """[b, R] left-aligned columns whose next-token logits score the response tokens (what
        :func:`response_outputs` reads: original columns S-R-1 .. S-2, less each row's shift), clamped to
        the ``keep`` columns that ran (a clamped column is past the row's end: masked like any response pad);
        None where only the whole output serves: not the lm head's last stage, or sequence parallelism (the
        output layer gathers the sequence shards itself)."""
        if self.head != "lm" or not self.is_last_stage or self.tf_config.sequence_parallel \
                or "responses" not in micro_batch:
            return None
        width, response_length = micro_batch["input_ids"].size(1), micro_batch["responses"].size(1)
        columns = torch.arange(width - response_length - 1, width - 1, device=shifts.device)
        return (columns[None, :] - shifts[:, None]).clamp(0, keep - 1)

    @property
    def module(self):
        """The GPTModel (unwrapped from DDP)."""
        return self.model.module if self.optimizer is not None else self.model

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """Megatron's optimizer (chained per parameter kind) wraps torch's: their state and fp32 main params."""
        if self.optimizer is None:
            return []
        return [inner.optimizer for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                if isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer)]

    @property
    def optimizer_steps(self) -> int:
        return int(self.scheduler.num_steps) if self.scheduler is not None else 0

    # ------------------------------------------------------------------ data parallelism
    @property
    def dp_group(self):
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_group()

    @property
    def is_output_rank(self) -> bool:
        """A DP replica's results are collected on its last stage's tp rank 0."""
        from megatron.core import parallel_state as mpu

        return self.is_last_stage and mpu.get_tensor_model_parallel_rank() == 0

    def training_layout(self):
        from megatron.core import parallel_state as mpu

        from verl.hybrid_engine.layouts import TrainingLayout

        tp, ep, etp = (mpu.get_tensor_model_parallel_world_size(), mpu.get_expert_model_parallel_world_size(),
                       mpu.get_expert_tensor_parallel_world_size())
        if not self.config.is_moe:  # a dense model ignores the process's expert groups
            ep, etp = 1, tp
        return TrainingLayout(tp=tp, pp=mpu.get_pipeline_model_parallel_world_size(),
                              dp=mpu.get_data_parallel_world_size(), ep=ep, etp=None if etp == tp else etp)

    def bind_reshard(self, model_config: ModelConfig, training: Any) -> BoundBuffer | None:
        """The distributed optimizer's one param buffer, or one the parameters are rebound into (once: the
        hybrid engine and the rollout pool's link share it); None when the distributed optimizer keeps
        them in several buffers (dense and expert), read by name then."""
        if self.lora is not None:  # the rollout takes merged weights, computed at every transition
            return None
        if not hasattr(self, "_reshard_buffer"):
            from verl.engine.megatron.reshard import bind_training_buffer

            self._reshard_buffer = bind_training_buffer(self.module, self.model, model_config, training)
        return self._reshard_buffer

    def reshard_readers(self):
        from verl.engine.base import ReshardReaders
        from verl.engine.megatron import lora, reshard

        return ReshardReaders(dense=reshard.megatron_reshard_sources, merged=lora.merged_reshard_sources,
                              lora_sync=reshard.MegatronLoRASyncSource)

    # ------------------------------------------------------------------ weights on disk
    def save_checkpoint(self, path: str) -> None:
        """dist_checkpointing (loadable at another (tp, pp)); RNG states are the trainer's."""
        self.require_onloaded("save_checkpoint")
        from verl.engine.megatron import checkpoint

        checkpoint.save_checkpoint(self, path, self.optimizer_steps, with_rng=False)

    def load_checkpoint(self, path: str) -> int:
        self.require_onloaded("load_checkpoint")
        from verl.engine.megatron import checkpoint

        return checkpoint.load_checkpoint(self, path)

    def export_hf(self, model_path: str, out_dir: str, tokenizer: Any | None) -> None:
        """Streamed by the first DP replica to rank 0 (:func:`verl.models.hf_export.export_actor_hf`). A LoRA
        actor: a PEFT adapter directory at ``out_dir`` (its base: ``model_path``), and with ``export_merged`` the
        merged model (``W + (alpha/r) B A``) as an HF directory at ``<out_dir>_merged``."""
        self.require_onloaded("export_hf")
        from verl.models.hf_export import export_actor_hf

        if self.lora is None:
            export_actor_hf(self, self.config, model_path, out_dir, tokenizer)
            return
        from verl.engine.lora.peft_io import write_adapter
        from verl.engine.megatron.lora import MergedView, gather_full_adapters

        adapters = gather_full_adapters(self.module, self.config)
        if dist.get_rank() == 0:
            write_adapter(out_dir, adapters, self.lora, model_path, tokenizer)
        if self.export_merged:
            export_actor_hf(_Exported(MergedView(self.module)), self.config, model_path, out_dir + "_merged",
                            tokenizer)
        dist.barrier()

    # ------------------------------------------------------------------ micro-batch schedule
    def _micro_batches(self, batch: Batch, micro_batch_size: int,
                       max_token_len: int | None) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
        """(micro-batches, the batch rows in micro-batch order or None when that is the batch's order)."""
        if max_token_len is None:
            return split_micro_batches(batch, micro_batch_size), None
        from megatron.core import parallel_state as mpu

        if mpu.get_pipeline_model_parallel_world_size() > 1:
            raise InputError(f"max_token_len={max_token_len}: token-budget micro-batches vary in rows, which "
                             f"pipeline stages cannot exchange: expected pipeline_model_parallel_size 1, found "
                             f"{mpu.get_pipeline_model_parallel_world_size()}")
        if self._token_exchange_group() is not None:
            raise InputError(f"max_token_len={max_token_len}: token-budget micro-batches vary in rows and count per "
                             f"rank, which the MoE token dispatcher's ranks cannot exchange: expected "
                             f"expert_model_parallel_size 1, found {mpu.get_expert_model_parallel_world_size()}")
        groups = token_budget_groups(batch["attention_mask"], max_token_len)
        micro_batches = [{k: v[torch.tensor(g, device=v.device)] for k, v in batch.items()} for g in groups]
        return micro_batches, torch.tensor([row for group in groups for row in group])

    def _kept_columns(self, aligned_mask: torch.Tensor) -> int:
        """Columns of a left-aligned micro-batch the model runs over: up to its longest row (the rest is padding
        in every row, which causal attention keeps out of every valid token; RL responses stop at very
        different lengths, so this is often far short of the padded width); the full width under pipeline
        parallelism, whose stages exchange activations of one agreed shape. Under sequence parallelism rounded
        up to a multiple of the TP size, which each rank holds an equal part of: past the padded width when
        that is not a multiple (the extra columns are padding, cut off the output)."""
        from megatron.core import parallel_state as mpu

        width = aligned_mask.size(1)
        keep = width if mpu.get_pipeline_model_parallel_world_size() > 1 \
            else min(width, max(1, int(aligned_mask.sum(dim=1).max())))
        group = self._token_exchange_group()
        if group is not None:  # every rank of the MoE dispatcher's group gathers the same [s, b] tokens
            agreed = torch.tensor([keep], dtype=torch.int64, device=aligned_mask.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            keep = int(agreed)
        return self._sequence_parallel_width(keep)

    @staticmethod
    def _variable_rows_ok() -> bool:
        """Whether micro-batches of different row counts can run: not under pipeline parallelism, whose stages
        exchange activations of one [s, b, h] shape."""
        from megatron.core import parallel_state as mpu

        return mpu.get_pipeline_model_parallel_world_size() == 1

    def _token_exchange_group(self):
        """The group whose ranks exchange tokens in every MoE layer (megatron's expert-tensor-and-model
        group, EP x ETP), when it has several ranks; None otherwise. Its allgather dispatcher gathers equal
        shapes, so its ranks run micro-batches of one agreed width."""
        from megatron.core import parallel_state as mpu

        if not self.config.is_moe or mpu.get_expert_tensor_and_model_parallel_world_size() == 1:
            return None
        return mpu.get_expert_tensor_and_model_parallel_group()

    def _sequence_parallel_width(self, columns: int) -> int:
        if not self.tf_config.sequence_parallel:
            return columns
        from megatron.core import parallel_state as mpu

        tp = mpu.get_tensor_model_parallel_world_size()
        return -(-columns // tp) * tp

    def _schedule(self, batch: Batch, micro_batch_size: int, output_fn: OutputFn, loss_fn: LossFn | None,
                  global_loss: bool = False, micro_batches: list[dict[str, torch.Tensor]] | None = None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_only = loss_fn is None
        if micro_batches is None:
            micro_batches = split_micro_batches(batch, micro_batch_size)
        rows = [next(iter(mb.values())).size(0) for mb in micro_batches]
        if len(set(rows)) > 1 and not self._variable_rows_ok():
            raise InputError(f"micro_batch_size={micro_batch_size}: expected a divisor of the batch's {sum(rows)} "
                             f"rows or at least them under pipeline parallelism, found micro-batches of {rows} rows: "
                             f"pipeline stages exchange activations of one micro-batch shape")
        micro_batch_size = max(rows)
        # Megatron divides each micro-batch's loss by their number; shares of a global loss must add up.
        loss_scale = len(micro_batches) if global_loss else 1

        device = get_device()

        def forward_step(data_iterator, model):
            micro_batch = to_device(next(data_iterator), device)
            ids, mask, shifts = left_align(micro_batch["input_ids"], micro_batch["attention_mask"],
                                           micro_batch.get("position_ids"))
            keep = self._kept_columns(mask)
            run_ids, run_mask = _to_columns(ids, keep), _to_columns(mask, keep)
            positions = torch.arange(keep, device=ids.device).expand(ids.size(0), keep)
            # MoE: padding tokens stay out of the router's load-balancing loss (megatron's padding_mask, True =
            # padding); they would otherwise pull the router and, through it, the pad positions' embeddings.
            extra = {"padding_mask": ~run_mask.bool()} if self.config.is_moe else {}
            if self.replay_routing and "routed_experts" in micro_batch:
                self._replay(micro_batch["routed_experts"], shifts, keep)
            # An output_fn that reads only the response (the actor's log-probs) takes the logits of the response
            # positions alone: the output layer, the logits and their log-softmax skip every prompt column.
            response_fn = getattr(output_fn, "response_fn", None)
            self._logit_positions = None if response_fn is None else self._response_positions(micro_batch, shifts,
                                                                                                keep)
            try:
                output = model(run_ids, positions, attention_mask_4d(run_mask), **extra)
            finally:
                gathered, self._logit_positions = self._logit_positions is not None, None
            if self.is_last_stage and not gathered:  # earlier stages pass on [s(/tp), b, h] hidden states as is
                output = _output_to_columns(output, keep, ids.size(1))

            def loss_func(output_tensor, non_loss_data=False):
                outputs = response_fn(output_tensor, micro_batch) if gathered \
                    else output_fn(output_tensor, ids, shifts, micro_batch)
                if forward_only:
                    return {k: v.detach() for k, v in outputs.items()}
                loss, metrics = loss_fn(outputs, micro_batch)
                # Clones: megatron scales the returned loss in place (1 / num_microbatches).
                return loss * loss_scale, {"loss": loss.detach().clone(),
                                           **{k: v.detach().clone() for k, v in metrics.items()}}

            return output, loss_func

        self.model.train(not forward_only)
        context = torch.no_grad() if forward_only else torch.enable_grad()
        try:
            with context:
                return get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.model],
                    num_microbatches=len(micro_batches),
                    # The width the pipeline stages exchange (the full width under pp > 1, see _kept_columns).
                    seq_length=self._sequence_parallel_width(batch["input_ids"].size(1)),
                    micro_batch_size=micro_batch_size, forward_only=forward_only, collect_non_loss_data=forward_only)
        finally:
            for router in self._routers:
                router.clear_indices()
                router.clear_router_replay_action()

    def _count_routed_tokens(self, index: int, router, args, output) -> None:
        """Forward hook of the stage's ``index``-th router: add its valid tokens' choices to the counts."""
        if self._expert_counts is None:
            return
        routing_map = output[1]  # [tokens, experts] bool, tokens in [s, b] order
        padding = args[1] if len(args) > 1 else None  # megatron's padding_mask, True = padding
        if padding is not None:
            routing_map = routing_map[~padding.reshape(-1)]
        self._expert_counts[index] += routing_map.sum(dim=0).to(self._expert_counts.dtype)

    def _router_metrics(self, micro_batches: int) -> dict[str, float]:
        """Per MoE layer: the load-balancing loss (megatron's tracker, per micro-batch, before its coefficient)
        and the routed tokens' spread over the experts (fractions of the layer's tokens; uniform = 1/E), summed
        over DP ranks (and the sequence shards of TP under sequence parallelism), every stage's layers on
        every rank. Names under ``actor/moe/`` (verl logs none for routers)."""
        from megatron.core import parallel_state as mpu
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        counts = self._expert_counts
        self._expert_counts = None
        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        layers = [self.config.moe_layers[i] for i in self._stage_moe_layers]
        # Each rank's loss per micro-batch: a sequence shard's part of it under sequence parallelism (megatron
        # sums those over TP, as its own logging does), then the mean over DP ranks.
        losses = (tracker["values"][layers].to(counts) / micro_batches if tracker is not None
                  else torch.zeros(len(layers), dtype=counts.dtype, device=counts.device))
        if self.tf_config.sequence_parallel:
            dist.all_reduce(counts, group=mpu.get_tensor_model_parallel_group())
            dist.all_reduce(losses, group=mpu.get_tensor_model_parallel_group())
        dist.all_reduce(counts, group=mpu.get_data_parallel_group())
        dist.all_reduce(losses, group=mpu.get_data_parallel_group())
        losses /= mpu.get_data_parallel_world_size()
        clear_aux_losses_tracker()
        per_layer = {}
        for index, layer in enumerate(layers):
            fractions = counts[index] / counts[index].sum().clamp(min=1)
            entry = {"load_max": float(fractions.max()), "load_min": float(fractions.min()),
                     "load_imbalance": float(fractions.max() * fractions.numel())}
            if tracker is not None:
                entry["load_balancing_loss"] = float(losses[index])
            per_layer[layer] = entry
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            stages = [None] * mpu.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(stages, per_layer, group=mpu.get_pipeline_model_parallel_group())
            per_layer = {layer: entry for stage in stages for layer, entry in stage.items()}
        metrics = {f"actor/moe/layer_{layer}/{name}": value for layer, entry in sorted(per_layer.items())
                   for name, value in entry.items()}
        imbalance = [entry["load_imbalance"] for entry in per_layer.values()]
        metrics["actor/moe/load_imbalance_max"] = max(imbalance)
        losses = [entry["load_balancing_loss"] for entry in per_layer.values() if "load_balancing_loss" in entry]
        if losses:
            metrics["actor/moe/load_balancing_loss"] = sum(losses) / len(losses)
        return metrics

    def _replay(self, routed: torch.Tensor, shifts: torch.Tensor, keep: int) -> None:
        """Hand every router of this stage its tokens' recorded experts: ``routed`` [b, S, MoE layers, k] is
        aligned with the micro-batch's columns; the model runs them left-aligned over ``keep`` columns, and a
        router sees tokens in megatron's [s, b] order (its sequence shard under sequence parallelism)."""
        from megatron.core import parallel_state as mpu
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        from verl.engine.padding import rotate

        b, width, _, k = routed.shape
        aligned = rotate(routed, shifts)[:, :keep, self._stage_moe_layers]
        if keep > width:  # columns past the batch's width are padding: any distinct experts do
            pad = torch.arange(k, dtype=aligned.dtype, device=aligned.device).expand(
                b, keep - width, aligned.size(2), k)
            aligned = torch.cat([aligned, pad], dim=1)
        tokens = aligned.transpose(0, 1)  # [keep, b, layers, k]
        if self.tf_config.sequence_parallel:
            tokens = tokens.chunk(mpu.get_tensor_model_parallel_world_size())[mpu.get_tensor_model_parallel_rank()]
        for index, router in enumerate(self._routers):
            router.clear_indices()
            router.set_target_indices(tokens[:, :, index].reshape(-1, k).long())
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _from_last_stage(self, value):
        """Hand the last pipeline stage's (small) result to every stage."""
        from megatron.core import parallel_state as mpu

        if mpu.get_pipeline_model_parallel_world_size() == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=mpu.get_pipeline_model_parallel_last_rank(),
                                   group=mpu.get_pipeline_model_parallel_group())
        return box[0]

    def forward(self, batch: Batch, micro_batch_size: int, output_fn: OutputFn,
                max_token_len: int | None = None) -> dict[str, torch.Tensor]:
        """output_fn's results for the whole batch (concatenated over micro-batches, in the batch's row
        order), on every stage, on the CPU (where the controller's DataProto lives), whatever device the
        model computes on. ``max_token_len``: micro-batches by token budget (:func:`token_budget_groups`)
        instead of ``micro_batch_size`` rows."""
        self.require_onloaded("forward")
        micro_batches, rows = self._micro_batches(batch, micro_batch_size, max_token_len)
        per_micro_batch = self._schedule(batch, micro_batch_size, output_fn, None, micro_batches=micro_batches)
        result = None
        if self.is_last_stage:
            result = {k: torch.cat([mb[k] for mb in per_micro_batch], dim=0).cpu() for k in per_micro_batch[0]}
            if rows is not None:  # back to the batch's order
                result = {k: torch.empty_like(v).index_copy_(0, rows, v) for k, v in result.items()}
        return self._from_last_stage(result)

    def train_step(self, batch: Batch, micro_batch_size: int, output_fn: OutputFn, loss_fn: LossFn, *,
                   global_loss: bool = False, summed_metrics: Collection[str] = (),
                   max_token_len: int | None = None) -> dict[str, float]:
        """One optimizer step over ``batch``; metrics are averaged over micro-batches and DP ranks.
        ``max_token_len``: micro-batches by token budget instead of ``micro_batch_size`` rows (verl's
        ``use_dynamic_bsz``; with ``global_loss`` the gradient is the same for any split).

        ``global_loss``: loss_fn returns shares of a globally normalised loss (see the module
        docstring); the shares are added over micro-batches (DDP averages the gradients over DP,
        which the shares' dp_size factor undoes). Then "loss" and the metrics named in
        ``summed_metrics`` (other shares) are added over micro-batches before the DP average, which
        makes them the mini-batch's loss; the rest (fractions, means) are averaged as before.
        """
        self.require_onloaded("train_step")
        from megatron.core import parallel_state as mpu

        if self.optimizer is None:
            raise RuntimeError("train_step: expected an engine built with an OptimConfig, found a forward-only engine")
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        micro_batches, _ = self._micro_batches(batch, micro_batch_size, max_token_len)
        if self.config.is_moe:  # every stage, even one without MoE layers: the metrics gather over PP
            self._expert_counts = torch.zeros(len(self._routers), self.config.num_experts, dtype=torch.float64,
                                              device=get_device())
        per_micro_batch = self._schedule(batch, micro_batch_size, output_fn, loss_fn, global_loss,
                                         micro_batches=micro_batches)
        router_metrics = self._router_metrics(len(micro_batches)) if self.config.is_moe else {}
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        metrics = None
        if self.is_last_stage:
            names = list(per_micro_batch[0])
            summed = set(summed_metrics) | {"loss"} if global_loss else set()
            per_name = {k: torch.stack([mb[k].float().reshape(()) for mb in per_micro_batch]) for k in names}
            stacked = torch.stack([per_name[k].sum() if k in summed else per_name[k].mean() for k in names])
            dist.all_reduce(stacked, group=mpu.get_data_parallel_group())
            stacked /= mpu.get_data_parallel_world_size()
            metrics = dict(zip(names, stacked.tolist(), strict=False))
        metrics = self._from_last_stage(metrics)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["update_successful"] = bool(updated)
        return {**metrics, **router_metrics}


class _Exported:
    """What :func:`export_actor_hf` reads of an engine: its ``module``."""

    def __init__(self, module: torch.nn.Module):
        self.module = module


class _BaseView(torch.nn.Module):
    """A LoRA model's base parameters under their own names (what the HF weight loader expects to find)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self._wrapped = [module]

    def named_parameters(self, *args, **kwargs):
        from verl.engine.lora import is_adapter_name

        return ((n, p) for n, p in self._wrapped[0].named_parameters(*args, **kwargs) if not is_adapter_name(n))


def engine_options(megatron: Any, model: Any = None) -> dict[str, Any]:
    """MegatronEngine keyword arguments from a role's verl ``megatron`` section (and the actor's ``model``):
    the params dtype, sequence parallelism and ``override_transformer_config`` (null entries dropped);
    ``model.enable_gradient_checkpointing`` turns on full activation recompute of every layer, as verl's
    Megatron workers do unless the overrides say otherwise."""
    from verl.utils.torch_dtypes import DTYPES

    # The reference's and the reward model's sections have no override_transformer_config, the reward model's
    # no sequence_parallel: they run without.
    overrides = {k: v for k, v in dict(megatron.get("override_transformer_config") or {}).items() if v is not None}
    if model is not None and model.enable_gradient_checkpointing and "recompute_granularity" not in overrides:
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {"params_dtype": DTYPES[megatron.dtype],
            "sequence_parallel": bool(megatron.get("sequence_parallel", False)),
            "transformer_overrides": overrides}


def _to_columns(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """A [B, S] input cut or zero-padded (pad tokens, masked out) to ``columns``."""
    if columns <= tensor.size(1):
        return tensor[:, :columns]
    return torch.nn.functional.pad(tensor, [0, columns - tensor.size(1)])


def _output_to_columns(output: torch.Tensor, ran: int, width: int) -> torch.Tensor:
    """A batch-first model output over ``ran`` columns, back to the batch's ``width``: zero-padded where fewer
    ran (the padded positions are masked out by every consumer, as they were when computed on pad tokens),
    cut where sequence parallelism ran more."""
    if output.dim() < 2 or output.size(1) != ran:
        raise RuntimeError(f"megatron output: expected [batch, {ran}, ...], found {tuple(output.shape)}")
    if ran >= width:
        return output[:, :width]
    return torch.nn.functional.pad(output, [0, 0] * (output.dim() - 2) + [0, width - ran])


def _use_fused_adam_on_cpu(optimizer) -> None:
    """Without TE/Apex megatron falls back to torch's AdamW, which on CPU tensors loops over parameters (a
    dozen small kernels each); its fused CPU kernel updates every tensor in one pass. Set before the first
    step, when the per-parameter state is created."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        params = [p for group in torch_optimizer.param_groups for p in group["params"]]
        if params and all(p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16) for p in params):
            for group in torch_optimizer.param_groups:
                group["fused"], group["foreach"] = True, False
