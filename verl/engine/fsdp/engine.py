"""One HF transformers model under FSDP2 (``fully_shard`` per decoder layer, then the root) on this
process's mesh (the ``fsdp`` / ``fsdp2`` strategies' :class:`~verl.engine.base.TrainingEngine`): forward(-backward)
over micro-batches, AdamW, gradient clipping, LR schedule, DCP checkpoints, HF export.

The same contract as :class:`verl.engine.megatron.engine.MegatronEngine`, so the roles and the trainer do
not change with the backend: ``forward(batch, micro_batch_size, output_fn, max_token_len)`` and
``train_step(batch, micro_batch_size, output_fn, loss_fn, global_loss=..., summed_metrics=...,
max_token_len=...)`` with ``output_fn(logits, aligned_ids, shifts, micro_batch)`` seeing rows left-aligned
by :func:`verl.engine.padding.left_align` (full-vocab logits here) and ``loss_fn`` returning shares
of a globally normalised loss when ``global_loss`` (see the Megatron engine's docstring).

Data parallelism is the whole world: every rank gets its own share of the batch and FSDP averages the
gradients over every rank (reduce-scatter within a shard group, all-reduce across replicas), as Megatron's
DDP averages over its DP group. With several micro-batches the gradient sync runs only on the last one.

``remove_padding`` (verl's ``model.use_remove_padding``), and token-budget micro-batches (verl's
``use_dynamic_bsz``) always: the valid tokens of a micro-batch are packed into one row with per-sequence
positions; transformers then masks attention block-diagonally, so no compute goes to padding; outputs are
scattered back to the padded layout for ``output_fn``.

Precision: parameters (the optimizer's master copy) in ``model_dtype``; ``param_dtype`` / ``reduce_dtype``
form FSDP's ``MixedPrecisionPolicy`` (bf16 compute with fp32 reductions on GPUs, fp32 on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist

from verl.engine.base import Batch, EngineSpec, LossFn, OptimConfig, OutputFn, TrainingEngine, optim_config
from verl.engine.fsdp.config_rules import RULES
from verl.engine.fsdp.model import (
    build_empty_hf_model,
    build_hf_model,
    load_sharded_weights,
    reset_buffers,
)
from verl.engine.fsdp.parallel import FSDPMesh, fsdp_mesh
from verl.engine.lora import LoRASettings, lora_export_options, lora_settings, model_key, value_head
from verl.engine.micro_batches import split_micro_batches, token_budget_groups
from verl.engine.padding import left_align
from verl.models.config import ModelConfig
from verl.models.hf_io import has_hf_weights
from verl.ops.cpu_gemm import use_onednn_for_nn_linears
from verl.utils.device import get_device, is_cuda_available, to_device
from verl.utils.torch_dtypes import torch_dtype


class LRSchedule:
    """Megatron's OptimizerParamScheduler rule, so an FSDP run follows the same LR curve as a Megatron
    run of the same config: linear warm-up from ``lr_warmup_init`` over ``lr_warmup_steps``, then
    constant, or linear / cosine decay to ``min_lr`` at ``lr_decay_steps`` (default: the total steps)."""

    def __init__(self, optimizer: torch.optim.Optimizer, optim: OptimConfig):
        self.optimizer = optimizer
        self.optim = optim
        self.num_steps = 0
        self._apply()

    def lr(self, step: int) -> float:
        o = self.optim
        if o.lr_warmup_steps and step <= o.lr_warmup_steps:
            return o.lr_warmup_init + (o.lr - o.lr_warmup_init) * step / o.lr_warmup_steps
        if o.lr_decay_style == "constant":
            return o.lr
        decay_steps = max(o.lr_decay_steps or o.total_training_steps, o.lr_warmup_steps + 1)
        if step > decay_steps:
            return o.min_lr
        ratio = (step - o.lr_warmup_steps) / (decay_steps - o.lr_warmup_steps)
        coeff = 1.0 - ratio if o.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return o.min_lr + coeff * (o.lr - o.min_lr)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(self.num_steps)

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()


def pack_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-aligned rows [b, S] -> (one packed row [1, T] of their valid tokens, positions [1, T] that restart
    at 0 for every sequence: transformers reads them as sequence boundaries)."""
    valid = mask.bool()
    positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
    return ids[valid][None, :], positions[valid][None, :]


class FSDPEngine(TrainingEngine):
    """``head``: ``lm`` (actor, reference), ``value`` (critic) or ``score`` (reward model)."""

    def __init__(self, config: ModelConfig, model_path: str, mesh: FSDPMesh, head: str = "lm",
                 optim: OptimConfig | None = None, *, model_dtype: torch.dtype = torch.float32,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 offload: bool = False, reshard_after_forward: bool = True, gradient_checkpointing: bool = False,
                 remove_padding: bool = False, seed: int = 0, lora: LoRASettings | None = None):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.config = config
        self.head = head
        self.mesh = mesh
        self.optim_config = optim
        self.remove_padding = remove_padding
        self.device = get_device()
        # With weights on disk the model is built on the meta device and each rank loads only its shards, so no
        # rank ever holds the full model (a 7B fp32 model would need 28 GB per rank); a config alone gets the
        # seeded full init on every rank (tiny models, tests).
        streamed = has_hf_weights(model_path)
        model = build_empty_hf_model(model_path, head, model_dtype) if streamed \
            else build_hf_model(model_path, head, model_dtype, seed)
        # LoRA (verl.engine.fsdp.lora): PEFT's layers go in before fully_shard, so FSDP shards the adapters too.
        self.lora = lora
        self.save_lora_only, self.export_merged = False, False  # from_spec reads them from the config
        # the HF checkpoint under the adapters, which a LoRA-only checkpoint records (verl.engine.lora)
        self.base_model_path: str | None = model_path if lora is not None and streamed else None
        if self.base_model_path is not None:
            from verl.engine.lora import base_fingerprint

            self.base_fingerprint: str | None = base_fingerprint(model_path)
        else:
            self.base_fingerprint = None
        if lora is not None:
            from verl.engine.fsdp import lora as lora_fsdp

            lora_fsdp.inject(model, lora, keep=value_head(head, RULES))
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # fp32 on CPU: the linears on oneDNN's GEMM (2x torch's MKL path on the update's shapes, results/roofline/)
        self.onednn_linears = use_onednn_for_nn_linears(model)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # Pinned host memory needs CUDA; on a CPU-only machine the shards are on the CPU anyway.
        offload_policy = CPUOffloadPolicy(pin_memory=is_cuda_available()) if offload else OffloadPolicy()
        kwargs = dict(mesh=mesh.mesh, mp_policy=policy, offload_policy=offload_policy,
                      reshard_after_forward=reshard_after_forward)
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        # Shards live on the compute device, or in host memory under CPU offload; the buffers (rotary tables, an
        # embedding's scale) are always on the compute device.
        if streamed:
            model.to_empty(device="cpu" if offload else self.device)
            load_sharded_weights(model, model_path, head)
            reset_buffers(model, self.device)
        elif not offload:
            model.to(self.device)
        else:
            reset_buffers(model, self.device)
        if lora is not None:
            full = None
            if lora.adapter_path:
                from verl.engine.lora.peft_io import read_adapter

                full = read_adapter(lora.adapter_path, lora, model_path)
            lora_fsdp.init_adapters(model, seed, full)
        self.model = model
        self.optimizer = None
        self.scheduler = None
        if optim is not None:
            # fused: one kernel over every shard. The CPU default loops over parameters, each update a dozen
            # DTensor dispatches: a quarter of a tiny model's update (0.74M Qwen2, one rank: 72 -> 54 ms).
            # requires_grad only: with LoRA the adapters (and a critic's value head) alone get optimizer state.
            trainable = [p for p in model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(trainable, lr=optim.lr, betas=tuple(optim.betas),
                                               weight_decay=optim.weight_decay, fused=True)
            self.scheduler = LRSchedule(self.optimizer, optim)
        self.is_last_stage = True  # no pipeline stages: every rank holds the whole (sharded) model

    def token_log_probs(self, compute_entropy: bool, temperature: float = 1.0) -> OutputFn:
        """output_fn: response log-probs (and entropy) from full-vocabulary logits."""
        from verl.engine.fsdp.log_probs import token_log_probs

        return token_log_probs(compute_entropy, temperature)

    @property
    def module(self) -> torch.nn.Module:
        """The fully_shard'ed root model (parameters are DTensors; names are the HF names)."""
        return self.model

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> FSDPEngine:
        """From the role's ``fsdp_config``, ``grad_clip`` and ``optim`` and ``spec.model``; the weights are always
        read from ``spec.model_path`` (each rank loads its shards), whoever sets them afterwards."""
        optim = None if spec.optim is None else optim_config(spec.optim, spec.total_training_steps,
                                                              clip_grad=spec.role.grad_clip)
        engine = fsdp_engine(spec.model_config, spec.model_path, spec.head, spec.role, spec.model, optim, spec.seed,
                             lora=lora_settings(spec.model, RULES, model_key(spec.head)))
        # param_offload is FSDP2's CPUOffloadPolicy here (shards and gradients live in host memory throughout)
        engine.save_lora_only, engine.export_merged = lora_export_options(spec)
        engine.idle_offload = {"params": False, "grads": False,
                               "optimizer": bool(spec.role.fsdp_config.get("optimizer_offload"))}
        return engine

    @property
    def optimizer_steps(self) -> int:
        return self.scheduler.num_steps if self.scheduler is not None else 0

    # ------------------------------------------------------------------ data parallelism
    @property
    def dp_group(self):
        """The world: every rank is a DP replica."""
        return dist.group.WORLD

    @property
    def is_output_rank(self) -> bool:
        return True

    def training_layout(self):
        from verl.hybrid_engine.layouts import FSDPLayout

        return FSDPLayout(shard=self.mesh.shard_size, replicate=self.mesh.replicate_size)

    def bind_reshard(self, model_config: ModelConfig, training: Any) -> None:
        """Nothing is rebound (FSDP owns the parameter objects): the local shards are checked against
        ``training`` and read by name at every transition."""
        from verl.engine.fsdp.reshard import FSDPReshardSource

        if self.lora is not None:  # the dense model's names: the rollout takes merged weights
            from verl.engine.fsdp.reshard import BaseNamesView

            return FSDPReshardSource(BaseNamesView(self.module)).bind_reshard(model_config, training)
        return FSDPReshardSource(self.module).bind_reshard(model_config, training)

    def reshard_readers(self):
        from verl.engine.base import ReshardReaders
        from verl.engine.fsdp import lora, reshard

        return ReshardReaders(reshard.fsdp_reshard_sources, lora.merged_reshard_sources, reshard.FSDPLoRASyncSource)

    # ------------------------------------------------------------------ weights on disk
    def save_checkpoint(self, path: str) -> None:
        """DCP (loadable at another world size); RNG states are the trainer's."""
        self.require_onloaded("save_checkpoint")
        from verl.engine.fsdp import checkpoint

        checkpoint.save_checkpoint(self, path, self.optimizer_steps)

    def load_checkpoint(self, path: str) -> int:
        self.require_onloaded("load_checkpoint")
        from verl.engine.fsdp import checkpoint

        return checkpoint.load_checkpoint(self, path)

    def export_hf(self, model_path: str, out_dir: str, tokenizer: Any | None) -> None:
        """One full parameter at a time to rank 0 (:func:`verl.engine.fsdp.hf_export.export_actor_hf`). A LoRA
        actor: a PEFT adapter directory at ``out_dir`` (its base: ``model_path``), and with ``export_merged`` the
        merged model as an HF directory at ``<out_dir>_merged``."""
        self.require_onloaded("export_hf")
        from verl.engine.fsdp.hf_export import export_actor_hf

        if self.lora is None:
            export_actor_hf(self, model_path, out_dir, tokenizer)
            return
        from verl.engine.fsdp.lora import full_adapters, iter_merged_tensors
        from verl.engine.lora.peft_io import write_adapter

        adapters = full_adapters(self.module)
        if dist.get_rank() == 0:
            write_adapter(out_dir, adapters, self.lora, model_path, tokenizer)
        if self.export_merged:
            export_actor_hf(self, model_path, out_dir + "_merged", tokenizer, iter_merged_tensors(self.module))
        dist.barrier()

    # ------------------------------------------------------------------ micro-batches
    def _micro_batches(self, batch: Batch, micro_batch_size: int,
                       max_token_len: int | None) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
        if max_token_len is None:
            return split_micro_batches(batch, micro_batch_size), None
        groups = token_budget_groups(batch["attention_mask"], max_token_len)
        micro_batches = [{k: v[torch.tensor(g, device=v.device)] for k, v in batch.items()} for g in groups]
        return micro_batches, torch.tensor([row for group in groups for row in group])

    def _model_output(self, micro_batch: dict[str, torch.Tensor],
                      pack: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output [b, S, V or 1] in the left-aligned layout, aligned ids, shifts)."""
        ids, mask, shifts = left_align(micro_batch["input_ids"], micro_batch["attention_mask"],
                                       micro_batch.get("position_ids"))
        if pack:
            packed, positions = pack_rows(ids, mask)
            out = self.model(input_ids=packed, position_ids=positions, use_cache=False).logits[0]
            output = out.new_zeros(ids.shape + out.shape[-1:])
            output[mask.bool()] = out
            return output, ids, shifts
        positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
        output = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        return output, ids, shifts

    def _packs(self, max_token_len: int | None) -> bool:
        """Pack rows when asked to, and always under a token budget: a budget counts valid tokens only, so
        its micro-batches carry no padding either."""
        return self.remove_padding or max_token_len is not None

    # ------------------------------------------------------------------ forward
    def forward(self, batch: Batch, micro_batch_size: int, output_fn: OutputFn,
                max_token_len: int | None = None) -> dict[str, torch.Tensor]:
        """output_fn's results for the whole batch, in the batch's row order, on the CPU."""
        self.require_onloaded("forward")
        micro_batches, rows = self._micro_batches(batch, micro_batch_size, max_token_len)
        self.model.eval()
        results = []
        with torch.no_grad():
            for micro_batch in micro_batches:
                micro_batch = to_device(micro_batch, self.device)
                output, ids, shifts = self._model_output(micro_batch, self._packs(max_token_len))
                results.append({k: v.detach().cpu() for k, v in output_fn(output, ids, shifts, micro_batch).items()})
        result = {k: torch.cat([r[k] for r in results], dim=0) for k in results[0]}
        if rows is not None:  # back to the batch's order
            result = {k: torch.empty_like(v).index_copy_(0, rows, v) for k, v in result.items()}
        return result

    # ------------------------------------------------------------------ one optimizer step
    def train_step(self, batch: Batch, micro_batch_size: int, output_fn: OutputFn, loss_fn: LossFn, *,
                   global_loss: bool = False, summed_metrics: Collection[str] = (),
                   max_token_len: int | None = None) -> dict[str, float]:
        """One optimizer step over ``batch``; metrics as :meth:`MegatronEngine.train_step` reports them
        (averaged over micro-batches and every rank; with ``global_loss`` the loss shares and
        ``summed_metrics`` are added over micro-batches first)."""
        self.require_onloaded("train_step")
        if self.optimizer is None:
            raise RuntimeError("train_step: expected an engine built with an OptimConfig, found a forward-only engine")
        micro_batches, _ = self._micro_batches(batch, micro_batch_size, max_token_len)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        per_micro_batch = []
        count = len(micro_batches)
        for index, micro_batch in enumerate(micro_batches):
            # Reduce-scatter the gradients once, after the last micro-batch's backward.
            self.model.set_requires_gradient_sync(index == count - 1)
            micro_batch = to_device(micro_batch, self.device)
            output, ids, shifts = self._model_output(micro_batch, self._packs(max_token_len))
            outputs = output_fn(output, ids, shifts, micro_batch)
            loss, metrics = loss_fn(outputs, micro_batch)
            # Shares of a global loss add up; a per-micro-batch mean loss is averaged.
            (loss if global_loss else loss / count).backward()
            per_micro_batch.append({"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}})
        grad_norm = self._clip_grad_norm()
        updated = math.isfinite(grad_norm)
        if updated:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # gradients are the size of the shards: free them now
        names = list(per_micro_batch[0])
        summed = set(summed_metrics) | {"loss"} if global_loss else set()
        per_name = {k: torch.stack([mb[k].float().reshape(()) for mb in per_micro_batch]) for k in names}
        stacked = torch.stack([per_name[k].sum() if k in summed else per_name[k].mean() for k in names])
        dist.all_reduce(stacked)
        stacked /= dist.get_world_size()
        metrics = dict(zip(names, stacked.tolist(), strict=True))
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["update_successful"] = updated
        return metrics

    def _clip_grad_norm(self) -> float:
        """The global gradient norm (over every shard) before clipping to ``optim.clip_grad``; nan/inf
        skips the step (verl's FSDP actor does the same)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.optim_config.clip_grad if self.optim_config.clip_grad else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)


def fsdp_engine(model_config: ModelConfig, model_path: str, head: str, role: Any, model: Any = None,
                optim: OptimConfig | None = None, seed: int = 0, lora: LoRASettings | None = None) -> FSDPEngine:
    """An FSDPEngine from a role's verl keys: ``fsdp_config`` (``fsdp_size``, ``model_dtype``,
    ``mixed_precision.{param,reduce}_dtype``, ``offload_policy``, ``reshard_after_forward``) and the
    actor's ``model`` section (``enable_gradient_checkpointing``, ``use_remove_padding``)."""

    def dtype(name: str | None):
        return torch_dtype(name) if name else None

    fsdp = role.fsdp_config
    mixed = fsdp.mixed_precision
    gpu = is_cuda_available()
    # Unset: bf16 compute with fp32 gradient reductions on GPUs (verl's default), the master dtype on the CPU.
    return FSDPEngine(
        model_config, model_path, fsdp_mesh(fsdp.fsdp_size), head, optim,
        model_dtype=dtype(fsdp.model_dtype),
        param_dtype=dtype(mixed.param_dtype or ("bfloat16" if gpu else None)),
        reduce_dtype=dtype(mixed.reduce_dtype or ("float32" if gpu else None)),
        # reward_model.fsdp_config has no offload_policy key
        offload=bool(fsdp.get("offload_policy") or fsdp.param_offload),
        reshard_after_forward=bool(fsdp.reshard_after_forward),
        gradient_checkpointing=model is not None and bool(model.enable_gradient_checkpointing),
        remove_padding=model is not None and bool(model.use_remove_padding), seed=seed, lora=lora)
