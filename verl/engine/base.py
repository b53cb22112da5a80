"""The training-engine contract: what a role (actor, reference, critic, reward model) needs of its engine,
whatever the backend (Megatron-core in (t, p, d), or transformers under FSDP2), and the types both engines share.

Batches are plain dicts of tensors sharing the batch dimension B (input_ids [B, S], attention_mask [B, S],
position_ids [B, S], responses [B, R], and whatever the loss reads). Every rank of a model-parallel group
passes the same batch; each DP replica passes its own share. Two callables plug a role into an engine:

  output_fn(output, aligned_ids, shifts, micro_batch) -> {name: tensor}
      the model's output for a micro-batch whose rows are left-aligned ([b, S, V] or [b, S, V/tp] logits,
      [b, S, 1] values or scores) into per-sample results (log-probs [b, R], entropy [b, R], values [b, R]);
  loss_fn(outputs, micro_batch) -> (loss, {metric: scalar tensor})
      the policy / value loss on those results; with ``train_step(global_loss=True)`` each micro-batch's
      share of a loss normalised over the whole mini-batch on every DP rank (verl's ``agg_loss``).

An engine is built from an :class:`EngineSpec` (the role's verl config sections) by
:func:`verl.engine.registry.build_engine`, which picks the backend from the role's ``strategy``.
Checkpoints (model + optimizer; RNG states stay the trainer's) and HF export belong to each engine, and so do
the 3D-HybridEngine's sources: the engine's :meth:`TrainingEngine.training_layout`, and its weights either bound
to one flat buffer (:meth:`TrainingEngine.bind_reshard`) or handed by name at every transition
(:meth:`TrainingEngine.reshard_sources`), so that the hybrid engine and the rollout pool never name a backend.
Between phases an engine's parameters, gradients and optimizer state can leave device memory
(:meth:`TrainingEngine.offload`, verl's ``param_offload`` / ``grad_offload`` / ``optimizer_offload``) and come
back bit for bit (:meth:`TrainingEngine.onload`); an offloaded engine refuses to compute.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from verl.engine.offload import StateOffload, local_tensor, optimizer_tensors
from verl.errors import InputError
from verl.models.config import ModelConfig

if TYPE_CHECKING:
    from verl.hybrid_engine.layouts import AnyTrainingLayout

Batch = Mapping[str, torch.Tensor]
OutputFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Batch], dict[str, torch.Tensor]]
LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclasses.dataclass
class OptimConfig:
    """Adam + megatron's OptimizerParamScheduler rule (names follow verl's actor.optim config)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_warmup_init: float = 0.0
    total_training_steps: int = 1
    lr_decay_steps: int | None = None  # None: total_training_steps
    lr_decay_style: str = "constant"  # constant | linear | cosine
    use_distributed_optimizer: bool = False

    def __post_init__(self):
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise InputError(f"optim.lr_decay_style: expected constant, linear or cosine, "
                             f"found {self.lr_decay_style!r}")
        if self.total_training_steps < 1 or self.lr_warmup_steps < 0:
            raise InputError(f"optim: expected total_training_steps >= 1 and lr_warmup_steps >= 0, found "
                             f"{self.total_training_steps} and {self.lr_warmup_steps}")


def optim_config(optim: Any, total_training_steps: int, use_distributed_optimizer: bool = False,
                 clip_grad: float | None = None) -> OptimConfig:
    """verl's ``*.optim`` keys as an OptimConfig. Warm-up as verl: ``lr_warmup_steps`` when >= 0, else
    ``lr_warmup_steps_ratio`` of the total steps; decay over ``lr_decay_steps`` (null: the total steps).
    ``clip_grad``: the FSDP roles' ``grad_clip`` (verl's dp actor/critic key) instead of ``optim.clip_grad``."""
    total = max(1, total_training_steps)
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total)
    return OptimConfig(lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                       betas=tuple(optim.betas),
                       clip_grad=optim.clip_grad if clip_grad is None else clip_grad, lr_warmup_steps=warmup,
                       lr_warmup_init=optim.lr_warmup_init, total_training_steps=total,
                       lr_decay_steps=optim.lr_decay_steps, lr_decay_style=optim.lr_decay_style,
                       use_distributed_optimizer=use_distributed_optimizer)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What a role asks of its engine, in verl's config sections (each backend reads its own keys)."""

    model_config: ModelConfig
    model_path: str  # the HF directory (or a bare config.json) the weights start from
    head: str  # lm (actor, reference) | value (critic) | score (reward model)
    role: Any  # the role's section: ``megatron`` or ``fsdp_config``, ``grad_clip``
    model: Any = None  # the role's ``model`` section (enable_gradient_checkpointing, use_remove_padding)
    optim: Any = None  # the role's ``optim`` section; None: a forward-only engine
    total_training_steps: int = 1
    seed: int = 0  # trainer.seed: the random init of a model given by its config alone
    load_weights: bool = True  # False: the caller sets the weights (the reference copies the actor's)
    layout_role: Any = None  # the role whose parallel layout this process follows; None: ``role``


class BoundBuffer(NamedTuple):
    """Training weights that are views of one flat buffer: the reshard binds its copy programs to ``flat`` once
    and addresses each parameter at ``offsets[name]`` (elements)."""

    flat: torch.Tensor
    offsets: dict[str, int]


class ReshardReaders(NamedTuple):
    """How a backend reads its weights by name for the reshard (imported when the reshard first asks):
    ``dense(module, dtype, device)`` and, with LoRA, ``merged(module, dtype, device)`` (adapters merged in), each
    ``{name: local shard, 1-D}``; ``lora_sync(module, model_config, settings, training)``: the adapter-only sync's
    :class:`~verl.hybrid_engine.lora_sync.LoRASyncSource`."""

    dense: Callable[..., dict[str, torch.Tensor]]
    merged: Callable[..., dict[str, torch.Tensor]]
    lora_sync: Callable[..., Any]


class TrainingEngine(abc.ABC):
    """One model (+ optimizer and LR schedule when built with an OptimConfig) on this rank's part of the
    job. ``config``: its ModelConfig; ``head``: lm | value | score; ``optimizer`` / ``scheduler``: None on a
    forward-only engine."""

    config: ModelConfig
    head: str
    optimizer: Any
    scheduler: Any
    # What the role's config asks to leave device memory while the engine is idle (verl's ``*_offload`` keys;
    # set by ``from_spec``): keyword arguments of :meth:`offload`.
    idle_offload: Mapping[str, bool] = {"params": False, "grads": False, "optimizer": False}
    # The engine's LoRA settings (:class:`verl.engine.lora.LoRASettings`) when it trains adapters.
    lora: Any = None

    @classmethod
    @abc.abstractmethod
    def from_spec(cls, spec: EngineSpec) -> TrainingEngine:
        """The engine a role's config sections describe, holding the weights of ``spec.model_path``."""

    # ------------------------------------------------------------------ compute
    @property
    @abc.abstractmethod
    def module(self) -> torch.nn.Module:
        """The model whose parameter names the weight loaders, the reshard and the HF export read."""

    @abc.abstractmethod
    def token_log_probs(self, compute_entropy: bool, temperature: float = 1.0) -> OutputFn:
        """output_fn: log p(responses[t] | prefix) [b, R] under ``logits / temperature`` (and entropy [b, R])."""

    @abc.abstractmethod
    def forward(self, batch: Batch, micro_batch_size: int, output_fn: OutputFn,
                max_token_len: int | None = None) -> dict[str, torch.Tensor]:
        """output_fn's results for the whole batch, in its row order, on the CPU, on every rank.
        ``max_token_len``: micro-batches by valid-token budget (verl's ``use_dynamic_bsz``) instead of
        ``micro_batch_size`` rows."""

    @abc.abstractmethod
    def train_step(self, batch: Batch, micro_batch_size: int, output_fn: OutputFn, loss_fn: LossFn, *,
                   global_loss: bool = False, summed_metrics: Collection[str] = (),
                   max_token_len: int | None = None) -> dict[str, float]:
        """One optimizer step over ``batch``: loss_fn's metrics averaged over micro-batches and DP ranks
        (with ``global_loss``, "loss" and ``summed_metrics`` added over micro-batches first), plus
        ``grad_norm``, ``lr`` and ``update_successful``."""

    @property
    @abc.abstractmethod
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (Adam's t; 0 on a forward-only engine): the checkpoint's iteration."""

    # ------------------------------------------------------------------ data parallelism
    @property
    @abc.abstractmethod
    def dp_group(self) -> Any:
        """The process group a role's batch is split over (one share per DP replica)."""

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(group=self.dp_group)

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(group=self.dp_group)

    @property
    @abc.abstractmethod
    def is_output_rank(self) -> bool:
        """Whether this rank's results are the ones its DP replica returns to the controller."""

    # ------------------------------------------------------------------ the 3D-HybridEngine's sources
    @abc.abstractmethod
    def training_layout(self) -> AnyTrainingLayout:
        """The layout the 3D-HybridEngine reads this engine's shards in (:mod:`verl.hybrid_engine.layouts`)."""

    @abc.abstractmethod
    def bind_reshard(self, model_config: ModelConfig, training: AnyTrainingLayout) -> BoundBuffer | None:
        """Check this rank's weights against ``training`` (the layout the reshard plan was made for) and
        return the one flat buffer they are views of, binding them into one where the backend can (once; a
        second call returns the same buffer); None when the reshard must read them by name at every
        transition (:meth:`reshard_sources`). Called once by the hybrid engine and by the rollout pool's link."""

    @abc.abstractmethod
    def reshard_readers(self) -> ReshardReaders:
        """This backend's readers of its weights by name (:meth:`reshard_sources`, :meth:`lora_sync_source`)."""

    def reshard_sources(self, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        """``{parameter name: this rank's local shard, 1-D}`` in the rollout's ``dtype`` on ``device``: views of
        the training weights where they already match, copies (dropped after the transition) otherwise; with
        LoRA, the dense weights with the adapters merged in. Read anew at every transition when
        :meth:`bind_reshard` returned None."""
        readers = self.reshard_readers()
        return (readers.dense if self.lora is None else readers.merged)(self.module, dtype, device)

    def lora_sync_source(self, model_config: ModelConfig, training: AnyTrainingLayout) -> Any:
        """The adapter-only sync's source (verl's ``lora.merge=false``): a
        :class:`~verl.hybrid_engine.lora_sync.LoRASyncSource` (the adapters' layout, the frozen base by name, the
        live adapters). None (the default: no LoRA, or ``merge=true``): the rollout takes the dense weights of
        :meth:`reshard_sources`, adapters merged in."""
        if self.lora is None or self.lora.merge:
            return None
        return self.reshard_readers().lora_sync(self.module, model_config, self.lora, training)

    # ------------------------------------------------------------------ weights on disk
    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Model + optimizer at ``path`` (atomic), the iteration being ``optimizer_steps``. Collective."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> int:
        """Model + optimizer from ``path`` (written by this backend); returns its iteration. Collective."""

    @abc.abstractmethod
    def export_hf(self, model_path: str, out_dir: str, tokenizer: Any | None) -> None:
        """The model as an HF directory at ``out_dir`` (replaced atomically), with the config and generation
        settings of ``model_path``. Collective; rank 0 writes."""

    # ------------------------------------------------------------------ device memory between phases
    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> int:
        """Move the named state to host memory (each storage once; see :mod:`verl.engine.offload`); returns
        the bytes moved. Nothing may compute until :meth:`onload`. Not collective."""
        if not hasattr(self, "_offload"):
            self._offload = StateOffload()
        tensors: list[torch.Tensor] = []
        model_params = list(self.module.parameters())
        if params:
            tensors += model_params
        if grads:
            tensors += [g for p in model_params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
        if optimizer:
            model_storages = {local_tensor(p).untyped_storage()._cdata for p in model_params}
            for torch_optimizer in self.torch_optimizers():
                tensors += optimizer_tensors(torch_optimizer, model_storages)
        return self._offload.offload(tensors)

    def offload_idle_state(self) -> int:
        """:meth:`offload` what the role's config names (``idle_offload``); 0 when it names nothing."""
        return self.offload(**self.idle_offload) if any(self.idle_offload.values()) else 0

    def onload(self) -> int:
        """Everything :meth:`offload` moved back in device memory, bit for bit; returns the bytes moved."""
        return self._offload.onload() if hasattr(self, "_offload") else 0

    @property
    def offloaded_bytes(self) -> int:
        return self._offload.offloaded_bytes if hasattr(self, "_offload") else 0

    def require_onloaded(self, what: str) -> None:
        if self.offloaded_bytes:
            raise RuntimeError(f"{what}: the engine's state is offloaded ({self.offloaded_bytes} bytes in host "
                               f"memory); call onload() first")

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose state this engine's optimizer holds (none on a forward-only engine)."""
        return [self.optimizer] if isinstance(self.optimizer, torch.optim.Optimizer) else []

    def swap_hf_weights(self, spec: EngineSpec) -> TrainingEngine:
        """This role's engine holding the HF checkpoint of ``spec`` (a forward-only engine's hot swap): a
        new engine here; a backend that can load the weights in place returns itself."""
        return type(self).from_spec(spec)
