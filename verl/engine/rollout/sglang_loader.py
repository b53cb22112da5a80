"""SGLang custom weight loader: one rank's resharded rollout bucket -> SGLang's parameters, in place.

SGLang calls :func:`load_rollout_bucket` inside each of its TP worker processes (engine arg
``custom_weight_loader=[LOADER_PATH]``, then ``update_weights_from_tensor(..., load_format=LOADER_PATH)``).
Every entry it receives is one bucket of that rank's flat rollout buffer, laid out exactly as
``rollout_param_specs(config, tp_size, tp_rank)`` in order, named by :func:`bucket_name` with the
element range it covers. SGLang 0.5.23 holds Qwen2/Llama parameters under the same names and
per-rank shapes (the model spec's rollout names: stacked QKV and gate/up, vocab padded to 64, KV
heads replicated when tp > kv heads), so each destination parameter gets one ``verl._C`` copy program: no HF renaming,
no per-tensor update calls, no intermediate full tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from verl.models.config import ModelConfig
from verl.models.rollout_shapes import RolloutParamSpec, rollout_param_specs
from verl.ops.copy_program import make_program, run_copy_program

LOADER_PATH = f"{__name__}.load_rollout_bucket"
_BUCKET_NAME = re.compile(r"^verl\.rollout_bucket\[(\d+):(\d+)\]$")


class RolloutBucketError(ValueError):
    """A bucket (or an SGLang model) that does not match the rollout layout."""


def bucket_name(start: int, end: int) -> str:
    """The name a bucket holding flat-buffer elements ``[start, end)`` travels under."""
    return f"verl.rollout_bucket[{int(start)}:{int(end)}]"


def parse_bucket_name(name: str) -> tuple[int, int]:
    match = _BUCKET_NAME.match(name)
    if not match or int(match.group(1)) > int(match.group(2)):
        raise RolloutBucketError(
            f"rollout bucket: expected a name like {bucket_name(0, 1024)!r}, found {name!r}"
        )
    return int(match.group(1)), int(match.group(2))


def spec_offsets(specs: list[RolloutParamSpec]) -> tuple[dict[str, int], int]:
    """Each tensor's element offset in the flat rollout buffer, and the buffer's total size."""
    offsets, offset = {}, 0
    for spec in specs:
        offsets[spec.name] = offset
        offset += spec.numel
    return offsets, offset


def check_model_matches_layout(params: dict[str, torch.Tensor], specs: list[RolloutParamSpec]) -> None:
    """Raise one RolloutBucketError naming the first difference between SGLang's params and the layout."""
    names = {spec.name for spec in specs}
    extra = sorted(set(params) - names)
    missing = sorted(names - set(params))
    if missing or extra:
        raise RolloutBucketError(
            f"SGLang model parameters differ from the rollout layout: missing in SGLang {missing[:3]}, "
            f"not in the layout {extra[:3]}"
        )
    for spec in specs:
        shape = tuple(params[spec.name].shape)
        if shape != spec.shape:
            raise RolloutBucketError(
                f"SGLang parameter {spec.name}: rollout layout expects shape {spec.shape}, SGLang holds {shape}"
            )
        if not params[spec.name].is_contiguous():
            raise RolloutBucketError(f"SGLang parameter {spec.name}: expected contiguous storage, found strided")


def copy_bucket(bucket: torch.Tensor, start: int, specs: list[RolloutParamSpec],
                params: dict[str, torch.Tensor]) -> int:
    """Copy flat-buffer elements ``[start, start + bucket.numel())`` into ``params``; return elements copied.

    One copy program per destination tensor the bucket overlaps (a tensor may straddle two buckets).
    """
    end = start + bucket.numel()
    offsets, total = spec_offsets(specs)
    if end > total:
        raise RolloutBucketError(
            f"rollout bucket [{start}:{end}]: expected to end within the rank's {total} rollout elements"
        )
    copied = 0
    for spec in specs:
        lo, hi = offsets[spec.name], offsets[spec.name] + spec.numel
        a, b = max(lo, start), min(hi, end)
        if a >= b:
            continue
        dst = params[spec.name].data
        if dst.element_size() != bucket.element_size() or dst.device != bucket.device:
            raise RolloutBucketError(
                f"SGLang parameter {spec.name}: expected {bucket.dtype} on {bucket.device} like the bucket, "
                f"found {dst.dtype} on {dst.device} (push weights in the engine's dtype)"
            )
        program = make_program([(a - start, a - lo, 1, b - a, b - a, b - a)])
        run_copy_program(bucket, dst.view(-1), program)
        copied += b - a
    return copied


def check_no_head_padding(hf_config, tp_size: int) -> None:
    """Reject SGLang's CPU head padding, a layout the rollout layout cannot be pushed into.

    On CPU, SGLang 0.5.23 (``adjust_config_with_unaligned_cpu_tp``) does not replicate KV heads
    when tp does not divide them: it pads the KV heads up to a multiple of tp (zero heads) and
    scales the query heads to keep the group size, so one rank holds every real head. The rollout
    layout (and SGLang on GPU) replicates KV heads and splits query heads evenly instead.
    """
    heads = getattr(hf_config, "original_num_attention_heads", hf_config.num_attention_heads)
    kv_heads = getattr(hf_config, "original_total_num_kv_heads", hf_config.num_key_value_heads)
    if (heads, kv_heads) != (hf_config.num_attention_heads, hf_config.num_key_value_heads):
        raise RolloutBucketError(
            f"SGLang padded attention heads for tp={tp_size} on CPU ({heads} -> {hf_config.num_attention_heads} "
            f"query, {kv_heads} -> {hf_config.num_key_value_heads} KV heads); the rollout layout replicates KV "
            f"heads instead: on CPU use a rollout tp that divides num_key_value_heads={kv_heads}"
        )


def _sglang_tp() -> tuple[int, int]:
    from sglang.srt.runtime_context import get_parallel  # SGLang 0.5.23's home of the TP coordinates

    parallel = get_parallel()
    return parallel.tp_size, parallel.tp_rank


# The buckets of the last push, kept open when they live in host shared memory. The trainer's ranks keep one
# shared buffer across steps, so the next push names the same file: torch rebuilds a storage it still holds
# from its cache instead of mapping the file and faulting every page in again (qwen2_100m bf16, rollout TP2,
# ~47 ms of a 62 ms push went there). Device buckets (CUDA IPC) are never kept: their sender frees them.
_OPEN_BUCKETS: list[torch.Tensor] = []


def load_rollout_bucket(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom-loader entry point: ``(model, [(bucket_name, flat bucket), ...])``."""
    tp_size, tp_rank = _sglang_tp()
    config = ModelConfig.from_dict(model.config.to_dict())
    check_no_head_padding(model.config, tp_size)
    specs = rollout_param_specs(config, tp_size, tp_rank)
    params = dict(model.named_parameters())  # a tied output layer is the embedding module: listed once
    check_model_matches_layout(params, specs)
    received = []
    with torch.no_grad():
        for name, bucket in named_tensors:
            start, end = parse_bucket_name(name)
            if bucket.dim() != 1 or bucket.numel() != end - start:
                raise RolloutBucketError(
                    f"rollout bucket {name}: expected a 1-D tensor of {end - start} elements, "
                    f"found shape {tuple(bucket.shape)}"
                )
            copy_bucket(bucket.contiguous(), start, specs, params)
            received.append(bucket)
    _OPEN_BUCKETS[:] = received if all(b.device.type == "cpu" and b.is_shared() for b in received) else []
