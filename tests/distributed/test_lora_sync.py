"""Adapter-only weight sync (issue 45 items 3 and 4), on gloo ranks.

Colocated, with the real engines: a Megatron TP 2 LoRA actor (``lora.merge=false``) and an FSDP 2 PEFT actor each
train a step, sync into native rollouts at rollout TP 1 and 2 (the first sync: the base, then the adapters), train
again and sync again (adapters only). After each sync every rollout rank's weights equal the merged oracle: the
base checkpoint's HF tensors plus ``(alpha/r) B @ A`` of the full adapters, in pure torch, cut by the rollout
layout. Adapter-only syncs move exactly HybridFlow's formula over the adapter bytes (counted here from the full
adapters), and nothing of the base. A sync whose adapter sources are stale while the trainer's adapter changed is
a ``LoRASyncError`` (verl #7495), and so is an applied adapter whose checksum is not the senders'.

Standalone pool, at the transfer level: 2 training ranks (Megatron TP 2 shards of seeded adapters) send to 2
rollout ranks (rollout TP 2); each rollout rank's merged shard equals the oracle; a stale adapter is
refused on the training side.
"""

import pytest
import torch
from helpers.megatron_tiny_models import hf_model, model_config, padded_batch, save_hf, sft_loss

from verl.launcher.spawn import run_ranks, run_ranks_with_rank

pytestmark = pytest.mark.distributed

RANK, ALPHA = 4, 8.0
BUCKET = 8 << 10  # several adapter buckets


def _batch(seed):
    from helpers.megatron_tiny_models import RESPONSE

    batch = padded_batch(seed=seed, batch=4)
    batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:]
    return batch


def _rollout_group(groups):
    import torch.distributed as dist

    mine = None
    for ranks in groups.rollout_tp_groups:
        group = dist.new_group(list(ranks)) if groups.rollout_tp > 1 else None
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _hf_base(base_dir, config):
    from verl.hybrid_engine.layouts import hf_tensor_shapes
    from verl.models.hf_io import HFCheckpoint

    ckpt = HFCheckpoint(base_dir)
    return {name: ckpt.get(name, shape) for name, shape in hf_tensor_shapes(config).items()}


def _adapter_elems(adapters, spec, config):
    """The logical adapter elements (a fused linear's shared A once): M of the bytes formula, counted here."""
    names = set(spec.shapes(config))
    return sum(t.numel() for k, t in adapters.items() if k in names)


def _sync_cases(engine, config, base, full_adapters, tp_sizes, batches, actor):
    """Per rollout TP: sync (base + adapters), check; step; sync (adapters only), check; a stale adapter source
    after one more step is refused; a corrupted adapter buffer is refused."""
    import torch.distributed as dist

    from verl.engine.rollout.native.engine import NativeRollout
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.hybrid_engine import HybridEngine
    from verl.hybrid_engine.lora_sync import LoRASyncError, merged_oracle

    training = engine.training_layout()
    out = {}
    for tg in tp_sizes:
        groups = derive_groups(training, tg)
        j = groups.rollout_tp_rank[dist.get_rank()]
        rollout = NativeRollout(config, tp_group=_rollout_group(groups), dtype=torch.float32)
        hybrid = HybridEngine(engine, rollout, config, training, tg, BUCKET, "float32")
        spec = hybrid.lora.source.spec
        r = {"syncs": []}
        for step in range(2):
            actor.update_policy(batches[step], sft_loss)
            metrics = hybrid.to_rollout()
            adapters = full_adapters()
            oracle = merged_oracle(config, spec, base, adapters, tg, j, torch.float32)
            got = rollout.params.views
            r["syncs"].append({
                "max_diff": max(float((got[n] - t).abs().max()) for n, t in oracle.items()),
                "moved": max(float((got[n] - t).abs().max()) for n, t in
                             merged_oracle(config, spec, base, {k: v * 0 for k, v in adapters.items()}, tg, j,
                                           torch.float32).items()),
                "bytes": metrics["perf/reshard_bytes"], "adapter_bytes": metrics["perf/lora_sync_bytes"],
                "base_bytes": metrics.get("perf/lora_base_sync_bytes"), "formula": hybrid.lora.plan.bytes_formula,
                "adapter_elems": _adapter_elems(adapters, spec, config)})
            hybrid.to_training()
        # verl #7495: the adapter sources are a stale snapshot while the trainer's adapter moved on
        source = hybrid.lora.source
        stale = {k: v.clone() for k, v in source.adapter_sources("cpu").items()}
        source.adapter_sources = lambda device, stale=stale: {k: v.clone() for k, v in stale.items()}
        actor.update_policy(batches[2], sft_loss)
        try:
            hybrid.to_rollout()
            r["stale"] = "no error"
        except LoRASyncError as err:
            r["stale"] = str(err)
        hybrid.to_training()
        del source.adapter_sources
        # a corrupted adapter buffer on rank 0: its applied checksum is not the senders' (rank 1's is)
        hybrid.lora.guard.applied = None
        run = hybrid.lora.executor.to_rollout

        def flipped(run=run, lora=hybrid.lora, **kwargs):
            stats = run(**kwargs)
            if dist.get_rank() == 0:
                lora.executor.rollout_flat[0] += 1.0
            return stats

        hybrid.lora.executor.to_rollout = flipped
        try:
            hybrid.to_rollout()
            r["corrupt"] = "no error"
        except LoRASyncError as err:
            r["corrupt"] = str(err)
        out[tg] = r
    return out


def _megatron_job(base_dir):
    from verl.engine.lora import MEGATRON_TARGETS, LoRASettings
    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.lora import gather_full_adapters
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor

    config = model_config(base_dir)
    initialize_megatron(2, 1, seed=3)
    lora = LoRASettings(rank=RANK, alpha=ALPHA, target_modules=MEGATRON_TARGETS, merge=False)
    engine = MegatronEngine(config, optim=OptimConfig(lr=1e-2, weight_decay=0.0, use_distributed_optimizer=True),
                            lora=lora, lora_seed=0)
    engine.load_hf_weights(base_dir)
    actor = Actor(engine, micro_batch_size=2)
    base = _hf_base(base_dir, config)
    out = _sync_cases(engine, config, base, lambda: gather_full_adapters(engine.module, config), (1, 2),
                      [_batch(s) for s in (1, 2, 3)], actor)
    destroy_megatron()
    return out


def _fsdp_job(base_dir):
    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.fsdp.lora import full_adapters
    from verl.engine.fsdp.parallel import fsdp_mesh
    from verl.engine.lora import LoRASettings
    from verl.engine.megatron.engine import OptimConfig
    from verl.engine.roles import Actor

    config = model_config(base_dir)
    # k_proj, gate_proj and up_proj not adapted: the rollout's fused q/k/v and gate/up are merged part by part
    lora = LoRASettings(rank=RANK, alpha=ALPHA, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"),
                        merge=False)
    engine = FSDPEngine(config, base_dir, fsdp_mesh(-1), "lm", OptimConfig(lr=1e-2, weight_decay=0.0), seed=0,
                        lora=lora)
    actor = Actor(engine, micro_batch_size=2)
    base = _hf_base(base_dir, config)
    return _sync_cases(engine, config, base, lambda: full_adapters(engine.module), (1, 2),
                       [_batch(s) for s in (1, 2, 3)], actor)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_hf(hf_model("qwen2_gqa_tied"), str(tmp_path_factory.mktemp("lora_sync") / "base"), sharded=False)


def _check(results, training_ranks_per_group):
    for rank, out in enumerate(results):
        for tg, r in out.items():
            first, second = r["syncs"]
            for sync in (first, second):
                assert sync["max_diff"] <= 1e-6, (rank, tg, sync)
                assert sync["moved"] > 1e-3, (rank, tg, sync)  # the adapters change the weights: the test can tell
            # HybridFlow's formula over the adapters, M counted from the full adapters (fp32): (m - 1)/m of M/t_g,
            # with m = p*t/t_g ranks per micro-DP group
            m = training_ranks_per_group // tg
            want = (m - 1) / m * 4 * second["adapter_elems"] / tg if m else 0
            assert second["adapter_bytes"] == first["adapter_bytes"] == second["formula"], (rank, tg, r)
            assert second["bytes"] == second["adapter_bytes"] and second["base_bytes"] is None, (rank, tg, second)
            assert first["base_bytes"] > first["adapter_bytes"] > 0 or tg == training_ranks_per_group
            if want:
                assert abs(second["adapter_bytes"] - want) <= 4 * tg, (rank, tg, second, want)
            assert "delivered nothing new" in r["stale"], (rank, tg, r["stale"])
            assert ("the senders sent" in r["corrupt"]) == (rank == 0), (rank, tg, r["corrupt"])


def test_megatron_tp2_adapter_only_sync_equals_the_merged_oracle(base_dir):
    results = run_ranks(_megatron_job, 2, base_dir, timeout_s=240)
    _check(results, 2)


def test_fsdp2_adapter_only_sync_equals_the_merged_oracle(base_dir):
    pytest.importorskip("peft")
    results = run_ranks(_fsdp_job, 2, base_dir, timeout_s=240)
    for rank, out in enumerate(results):
        for tg, r in out.items():
            for sync in r["syncs"]:
                assert sync["max_diff"] <= 1e-6 and sync["moved"] > 1e-3, (rank, tg, sync)
            second = r["syncs"][1]
            assert second["bytes"] == second["adapter_bytes"] == second["formula"], (rank, tg, second)
            assert "delivered nothing new" in r["stale"], (rank, tg, r["stale"])
            assert ("the senders sent" in r["corrupt"]) == (rank == 0), (rank, tg, r["corrupt"])


# ------------------------------------------------------------------------------------------- standalone pool
def _pool_job(rank, nproc, cfg, rollout_tp, replicas):
    """Bridge ranks 0, 1: Megatron TP 2 training shards of seeded base weights and adapters; ranks 2, 3: the pool.
    Sync 1 (base + adapters), a step (new adapters), sync 2 (adapters only, into a buffer that lost everything),
    then a stale adapter source after another step: refused on the training side."""
    import torch.distributed as dist

    from verl.bench.lora_sync import ShardSource, adapter_spec, random_adapters
    from verl.bench.reshard_reference import random_hf_weights
    from verl.bench.weight_sync import training_shard
    from verl.hybrid_engine.cross_pool import PoolPlacement, plan_cross_pool
    from verl.hybrid_engine.layouts import TrainingLayout
    from verl.hybrid_engine.lora_sync import (
        AdapterTrainingLayout,
        LoRASyncError,
        PoolLoRAReceiver,
        PoolLoRASender,
        merged_oracle,
    )
    from verl.hybrid_engine.rollout_layout import rollout_param_specs
    from verl.hybrid_engine.weight_sync import PoolReceiver, PoolSender
    from verl.launcher.pools import Bridge
    from verl.models.config import ModelConfig

    config = ModelConfig.from_dict(cfg)
    training = TrainingLayout(2, 1, 1)
    placement = PoolPlacement(training, rollout_tp, replicas)
    bridge = Bridge(dist.distributed_c10d._get_default_group(), rank, nproc)
    train_group = dist.new_group([0, 1])
    spec = adapter_spec(config, RANK, ALPHA)
    hf = random_hf_weights(config, 5)
    full = random_adapters(config, spec, 1)
    plan = plan_cross_pool(config, placement, rank, BUCKET, "float32")
    records = []
    if rank < 2:
        source = ShardSource(config, AdapterTrainingLayout(training, spec), rank, full)
        lora = PoolLoRASender(source, config, placement, rank, BUCKET, bridge, verify=True, group=train_group)
        flat, offsets = training_shard(config, training, rank, hf, torch.float32)
        base = PoolSender(plan, flat, offsets, bridge, verify=True)
        sources = None
        for step in range(3):
            if step == 2:  # verl #7495: the sources stop following the live adapter (the last sync's again)
                source.adapter_sources = lambda device, stale=sources: stale
            try:
                sources, info = lora.prepare("cpu")
            except LoRASyncError as err:
                info, sources = {"error": str(err)}, None
            if rank == 0:
                for dst in range(2, nproc):
                    bridge.send_object(info, dst)
            if sources is None:
                records.append(info["error"])
                break
            if step == 0:
                base.send()
            records.append(lora.send(sources).bytes)
            full.update(random_adapters(config, spec, 2 + step))  # the step: new adapters, in place
        return records
    j = (rank - 2) % rollout_tp
    specs = [(s.name, s.shape) for s in rollout_param_specs(config, rollout_tp, j)]
    receiver = PoolReceiver(plan, specs, bridge, verify=True)
    lora = PoolLoRAReceiver(config, PoolPlacement(AdapterTrainingLayout(training, spec), rollout_tp,
                                                  replicas), rank, BUCKET, bridge)
    for step in range(3):
        info = bridge.recv_object(0)
        if "error" in info:
            records.append(info["error"])
            break
        target = torch.zeros(receiver.numel)  # the engine dropped its buffer: everything comes from the kept base
        if step == 0:
            receiver.zero_padding(target)
            receiver.receive(target)
            lora.capture_base(target)
        metrics = lora.receive(target, restore=step > 0, info=info)
        oracle = merged_oracle(config, spec, hf, full, rollout_tp, j, torch.float32)
        got = {n: target[o:o + t.numel()].view(t.shape) for (n, _), o, t in
               zip(specs, receiver.offsets.values(), oracle.values(), strict=True)}
        records.append({"max_diff": max(float((got[n] - t).abs().max()) for n, t in oracle.items()),
                        "bytes": metrics["perf/lora_sync_bytes"], "payload": lora.plan.payload_elems[j] * 4})
        full.update(random_adapters(config, spec, 2 + step))
    return records


@pytest.mark.parametrize("rollout_tp,replicas", [(2, 1)])
def test_pool_adapter_only_sync_equals_the_merged_oracle(rollout_tp, replicas):
    import dataclasses
    import os

    from helpers.train_runs import REPO

    from verl.models.config import ModelConfig

    cfg = dataclasses.asdict(ModelConfig.from_pretrained(os.path.join(REPO, "configs", "models",
                                                                      "qwen2_tiny_arith.json")))
    ranks = run_ranks_with_rank(_pool_job, 4, cfg, rollout_tp, replicas, timeout_s=120)
    for pool_rank in ranks[2:]:
        syncs, error = pool_rank[:2], pool_rank[2]
        for sync in syncs:
            assert sync["max_diff"] <= 1e-6, pool_rank
            assert sync["bytes"] == sync["payload"] > 0, pool_rank  # its adapter shard, exactly, once per sync
        assert "adapters about to be sent are the last sync's" in error, error
    for train_rank in ranks[:2]:
        assert train_rank[0] == train_rank[1] > 0 and "verl #7495" in train_rank[2], train_rank


def test_megatron_tp2_adapter_only_sync_on_gemma3s_block(tmp_path):
    """The same on Gemma 3's block (issue 58 item 3; tests/helpers/megatron_tiny_models.py BLOCK_CONFIGS): its
    adapters sit in the attention and MLP modules that also own the sandwich norms."""
    base = save_hf(hf_model("gemma3_sliding_softcap"), str(tmp_path / "base"), sharded=False)
    results = run_ranks(_megatron_job, 2, base, timeout_s=240)
    _check(results, 2)
