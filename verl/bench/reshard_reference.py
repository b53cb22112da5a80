"""What the reshard benches share (``verl bench reshard``, its ``--separate`` weight sync and its LoRA sync): seeded
full HF weights, the rollout shards cut straight from them (the reference every reshard is checked against), and
one timer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from verl.models.config import ModelConfig


def random_hf_weights(config: ModelConfig, seed: int, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A full HF-style (unfused) weight set, identical on every rank for the same seed and device type
    (``cuda``: drawn by the GPU's own generator, seconds less than the CPU's for a 0.5B model)."""
    from verl.hybrid_engine.layouts import hf_tensor_shapes

    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.randn(*shape, generator=gen, device=device).to(dtype)
            for name, shape in hf_tensor_shapes(config).items()}


def reference_rollout_shard(config: ModelConfig, hf: dict[str, torch.Tensor], tp: int, tp_rank: int,
                            dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Rollout rank ``tp_rank``'s parameters cut straight from the full HF weights ``hf`` (on ``device``)."""
    return dict(reference_rollout_params(config, hf.__getitem__, tp, tp_rank, dtype, device))


def reference_rollout_params(config: ModelConfig, source, tp: int, tp_rank: int, dtype: torch.dtype,
                             device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of rollout rank ``tp_rank``'s parameters one at a time, each cut from ``source(hf_name)``
    (the full HF tensor, or anything ``layouts.fill_local`` can index like it): one parameter in memory at once."""
    from verl.hybrid_engine.layouts import fill_local, hf_tensor_shapes
    from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs

    shapes = hf_tensor_shapes(config)
    for param, spec in zip(RolloutLayout(tp).params(config), rollout_param_specs(config, tp, tp_rank), strict=True):
        out = torch.empty(spec.shape, dtype=dtype, device=device)
        fill_local(param, shapes, tp, tp_rank, out, source)
        yield spec.name, out


def rollout_targets(config: ModelConfig, rollout_tp: int, tp_rank: int) -> dict[str, list]:
    """HF tensor name -> the (rollout parameter, piece) rectangles rollout rank ``tp_rank`` holds of it."""
    from verl.hybrid_engine.layouts import hf_tensor_shapes, local_pieces
    from verl.hybrid_engine.rollout_layout import RolloutLayout

    shapes = hf_tensor_shapes(config)
    out: dict[str, list] = {}
    for param in RolloutLayout(rollout_tp).params(config):
        for piece in local_pieces(param, shapes, rollout_tp, tp_rank)[1]:
            out.setdefault(piece.tensor, []).append((param.name, piece))
    return out


def copy_into_rollout(name: str, full: torch.Tensor, targets: dict[str, list],
                      rollout_params: dict[str, torch.Tensor]) -> None:
    """Narrow/copy one full HF tensor into this rank's rollout parameters."""
    rows = full.reshape(full.shape[0], -1)
    for target, p in targets[name]:
        dst = rollout_params[target]
        dst.view(dst.shape[0], -1)[p.local_row:p.local_row + p.rows, p.local_col:p.local_col + p.cols].copy_(
            rows[p.row:p.row + p.rows, p.col:p.col + p.cols])


def timed(fn, repeats: int, device: torch.device | None = None) -> float:
    """Best-of-``repeats`` wall time of a collective step, barrier to barrier (on CUDA to completion: the
    device is synchronised before each barrier)."""
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        dist.barrier()
        start = time.perf_counter()
        fn()
        sync()
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best
