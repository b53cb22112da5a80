"""HF safetensors checkpoint -> one rollout TP rank's rollout-layout tensors.

Each rollout parameter is cut from its HF tensors by the rollout layout's pieces (``layouts.fill_local``),
so only the slices this rank holds are read (``verl.models.hf_io.HFCheckpoint.slice``) and each lands
directly in the engine's flat buffer: q/k/v rows of the rank's heads (KV heads replicated when tp > kv
heads), gate/up rows of its FFN slice, the input-dim columns of row-parallel weights, the rows of its
slice of the vocabulary padded to a multiple of 64 (padding rows are zero).
"""

from __future__ import annotations

import torch

from verl.hybrid_engine.layouts import fill_local, hf_tensor_shapes
from verl.hybrid_engine.rollout_layout import RolloutLayout
from verl.models.config import ModelConfig
from verl.models.hf_io import HFCheckpoint
from verl.models.mcore.weights import check_expert_tensors
from verl.models.spec.registry import model_spec
from verl.utils.checkpoint import CheckpointError


def load_hf_checkpoint(model_dir: str, config: ModelConfig, tp_size: int, tp_rank: int,
                       views: dict[str, torch.Tensor]) -> None:
    """Fill ``views`` (rollout-layout name -> destination tensor) with rank ``tp_rank``'s slices."""
    ckpt = HFCheckpoint(model_dir)
    spec = model_spec(config.model_type)
    unsupported = [n for n in ckpt.files if n.endswith(spec.unsupported_hf)]
    if unsupported:
        raise CheckpointError(f"HF checkpoint: {spec.unsupported_note}, found {unsupported[0]}")
    check_expert_tensors(config, ckpt.files)
    shapes = hf_tensor_shapes(config)
    for param in RolloutLayout(tp_size).params(config):
        fill_local(param, shapes, tp_size, tp_rank, views[param.name], lambda name: ckpt.slice(name, shapes[name]))
