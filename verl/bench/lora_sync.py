"""The adapter-only sync (:mod:`verl.hybrid_engine.lora_sync`) on seeded adapters, for ``verl bench reshard
--lora-rank R`` and the transfer-level tests: every rank cuts its training shard of the same seeded full adapters
by the adapter training layout, the sync runs as in the trainer, and each rollout rank's adapter shard is checked
bit-exactly against the one cut straight from the full adapters, and its merged shard against the pure-torch merge.
"""

from __future__ import annotations

import math
import time

import torch

from verl.models.config import ModelConfig

# The spec's roles of Megatron's four adapted linears (linear_qkv, linear_proj, linear_fc1, linear_fc2).
LINEAR_ROLES = ("qkv", "attn_out", "gate_up", "mlp_out")


def adapter_spec(config: ModelConfig, rank: int, alpha: float, shared_a: bool = True, modules=None):
    """Every decoder linear adapted (``all-linear`` / Megatron's four linears) unless ``modules`` names them;
    ``shared_a``: a fused linear shares one ``A`` (Megatron's adapters) or each HF module has its own (PEFT's)."""
    from verl.hybrid_engine.layouts import hf_tensor_shapes
    from verl.hybrid_engine.lora_sync import AdapterSpec
    from verl.models.spec.registry import model_spec

    if modules is None:  # the HF weights of the spec's four dense linears (not the MoE router, not biases)
        params = model_spec(config.model_type).mcore_params(config, 1, 0)
        linear = {name for p in params if p.role in LINEAR_ROLES and p.mcore.endswith(".weight") for name in p.hf}
        modules = tuple(name for name in hf_tensor_shapes(config) if name in linear)  # in HF order
    return AdapterSpec(rank, alpha / rank, tuple(modules), shared_a=shared_a)


def random_adapters(config: ModelConfig, spec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=gen) * 0.1 for name, shape in spec.shapes(config).items()}


class ShardSource:
    """A training rank's adapter sync source over full adapters (``full``, replaced to model a step): the same
    interface as the engines' (``spec``, ``training``, ``adapter_sources``, ``fingerprint``)."""

    def __init__(self, config: ModelConfig, training, rank: int, full: dict[str, torch.Tensor]):
        self.config, self.training, self.spec, self.rank, self.full = config, training, training.spec, rank, full

    def adapter_params(self) -> dict[str, torch.Tensor]:
        from verl.hybrid_engine.layouts import fill_local, local_shape

        shapes = self.spec.shapes(self.config)
        stage, _, r = self.training.coords(self.rank)
        out = {}
        for p in self.training.params(self.config, stage):
            local = torch.empty(local_shape(p, shapes, self.training.tp, r))
            fill_local(p, shapes, self.training.tp, r, local, self.full.__getitem__)
            out[p.name] = local
        return out

    def adapter_sources(self, device) -> dict[str, torch.Tensor]:
        return {n: t.to(device).reshape(-1) for n, t in self.adapter_params().items()}

    def fingerprint(self) -> int:
        from verl.hybrid_engine.lora_sync import live_fingerprint

        return live_fingerprint(self.adapter_params())


def reference_adapter_shard(config: ModelConfig, spec, full, rollout_tp: int, j: int) -> torch.Tensor:
    """Rollout rank ``j``'s adapter buffer cut straight from the full adapters."""
    from verl.hybrid_engine.layouts import fill_local
    from verl.hybrid_engine.lora_sync import AdapterRolloutLayout

    layout = AdapterRolloutLayout(rollout_tp, spec)
    shapes = spec.shapes(config)
    parts = []
    for p, (_, shape) in zip(layout.params(config), layout.specs(config, j), strict=True):
        local = torch.empty(shape)
        fill_local(p, shapes, rollout_tp, j, local, full.__getitem__)
        parts.append(local.reshape(-1))
    return torch.cat(parts)


def colocated_lora_rank(rank: int, nproc: int, cfg: dict, train: tuple, rollout_tp: int, lora_rank: int,
                        dtype_name: str, bucket_bytes: int, seed: int, repeats: int) -> dict:
    """One Megatron (``train`` = (tp, pp, dp)) rank of the colocated adapter sync: verified, timed (the adapter
    reshard + its proof, and the merge into a rollout shard of ``dtype_name``), with its bytes and formula."""
    from verl.bench.reshard_reference import random_hf_weights, reference_rollout_shard
    from verl.hybrid_engine.executor import ReshardProcessGroups
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.layouts import TrainingLayout
    from verl.hybrid_engine.lora_sync import AdapterTrainingLayout, ColocatedLoRASync
    from verl.utils.torch_dtypes import DTYPES

    config = ModelConfig.from_fields(cfg)
    dtype = DTYPES[dtype_name]
    spec = adapter_spec(config, lora_rank, 2.0 * lora_rank)
    training = AdapterTrainingLayout(TrainingLayout(*train), spec)
    full = random_adapters(config, spec, seed)
    source = ShardSource(config, training, rank, full)
    groups = derive_groups(training, rollout_tp)
    j = groups.rollout_tp_rank[rank]
    sync = ColocatedLoRASync(source, config, rollout_tp, bucket_bytes, groups, ReshardProcessGroups(groups))
    hf = random_hf_weights(config, seed, dtype)
    base = reference_rollout_shard(config, hf, rollout_tp, j, dtype)
    flat = torch.cat([t.reshape(-1) for t in base.values()])
    sync.capture_base(flat)
    sync.sync(flat, restore=True)
    got = sync.executor.rollout_flat.clone()
    verified = torch.equal(got, reference_adapter_shard(config, spec, full, rollout_tp, j))
    times, merges = [], []
    for step in range(repeats):
        full.update(random_adapters(config, spec, seed + 1 + step))  # a step: every adapter changed
        start = time.perf_counter()
        metrics = sync.sync(flat, restore=True)
        times.append(time.perf_counter() - start)
        merges.append(metrics["timing_s/lora_merge"])
    elems = sum(math.prod(s) for s in spec.shapes(config).values())
    return {"verified": verified, "bytes_received": sync.plan.bytes_received, "bytes_formula": sync.plan.bytes_formula,
            "model_bytes": sync.plan.model_bytes, "adapter_params": elems, "seconds": min(times),
            "merge_seconds": min(merges), "base_copy_bytes": sync.applier.base_bytes,
            "merged_elems": sync.applier.merged_elems}


def lora_summary(ranks: list[dict], lora_rank: int, dense: dict) -> dict:
    """The bench's LoRA figures beside the dense ones."""
    first = ranks[0]
    received = [r["bytes_received"] for r in ranks]
    mean = sum(received) / len(received)
    return {"lora_rank": lora_rank, "lora_verified": all(r["verified"] for r in ranks),
            "lora_adapter_params": first["adapter_params"],
            "lora_bytes_received_per_rank": received, "lora_bytes_received_mean": mean,
            "lora_bytes_formula": first["bytes_formula"],
            "lora_bytes_received_equals_formula": first["bytes_formula"] is not None
            and abs(mean - first["bytes_formula"]) <= 4 * len(ranks),
            "lora_seconds": first["seconds"], "lora_merge_seconds": first["merge_seconds"],
            "lora_base_copy_bytes": first["base_copy_bytes"],
            "lora_over_dense_bytes": mean / dense["bytes_received_mean"] if dense.get("bytes_received_mean") else None,
            "lora_over_dense_seconds": first["seconds"] / dense["seconds"] if dense.get("seconds") else None}
