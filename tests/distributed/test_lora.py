"""LoRA on both training engines (verl.engine.lora) on 2 gloo ranks, against a pure-torch oracle.

The oracle is the HF checkpoint with every targeted linear replaced by ``W + (alpha/r) B A`` (torch, full
tensors): the LoRA engine's log-probs equal those of a dense engine of the same backend and layout holding that
merged checkpoint, and, with the adapters disabled (the reference), those of the untouched base checkpoint.
Megatron at TP 2 (sequence parallel, distributed optimizer) and at PP 2; FSDP2 over 2 ranks. After one training
step only the adapters moved, only they hold optimizer state, the adapter shards gather back to the full HF
adapter (fused q/k/v and gate/up: the same A, B split by rows), and the merged reshard sources equal the merged
checkpoint's shards. The PEFT round trip: the adapter written in PEFT's format loads with
``peft.PeftModel.from_pretrained`` and gives the oracle's logits.
"""

import pytest
import torch
from helpers.megatron_tiny_models import RESPONSE, hf_model, model_config, padded_batch, save_hf

from verl.launcher.spawn import run_ranks

pytestmark = pytest.mark.distributed

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOL = 2e-5  # fp32: the LoRA and dense forwards differ in the summation order of W x + s B A x only


def full_adapter(model, seed=5):
    """Random full HF-named adapters for every targeted linear; fused q/k/v and gate/up share one A."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in HF_LINEARS:
            continue
        out_dim, in_dim = module.weight.shape
        shared = name.rsplit(".", 1)[0] + (".qkv" if leaf in ("q_proj", "k_proj", "v_proj") else
                                           ".gate_up" if leaf in ("gate_proj", "up_proj") else f".{leaf}")
        if shared not in out:
            out[shared] = torch.randn(RANK, in_dim, generator=g) * 0.3
        out[f"{name}.lora_A.weight"] = out[shared]
        out[f"{name}.lora_B.weight"] = torch.randn(out_dim, RANK, generator=g) * 0.3
    return {k: v for k, v in out.items() if k.endswith(".weight")}


def merged_model(model, adapter):
    import copy

    merged = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in merged.named_modules():
            if f"{name}.lora_A.weight" in adapter:
                module.weight += SCALE * adapter[f"{name}.lora_B.weight"] @ adapter[f"{name}.lora_A.weight"]
    return merged


def _megatron_job(base_dir, merged_dir, adapter):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from verl.engine.lora import MEGATRON_TARGETS, LoRASettings, adapter_parameters
    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.lora import gather_full_adapters, load_full_adapters
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import to_mcore_shard

    config = model_config(base_dir)
    batch = padded_batch(batch=4)
    batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:]
    lora = LoRASettings(rank=RANK, alpha=ALPHA, target_modules=MEGATRON_TARGETS)
    out = {}
    for name, (tp, pp, distopt) in {"tp2": (2, 1, True), "pp2": (1, 2, False)}.items():
        initialize_megatron(tp, pp, seed=3)
        engine = MegatronEngine(config, optim=OptimConfig(lr=1e-2, weight_decay=0.0, use_distributed_optimizer=distopt),
                                sequence_parallel=tp > 1, lora=lora)
        engine.load_hf_weights(base_dir)
        load_full_adapters(engine.module, config, lambda n: adapter[n])
        dense = {}
        for which, path in (("base", base_dir), ("merged", merged_dir)):
            ref_engine = MegatronEngine(config, sequence_parallel=tp > 1)
            ref_engine.load_hf_weights(path)
            dense[which] = Actor(ref_engine, micro_batch_size=2).compute_log_prob(batch, False)["log_probs"]
        actor = Actor(engine, micro_batch_size=2)
        lora_lp = actor.compute_log_prob(batch, False)["log_probs"]
        ref_lp = Actor(engine, micro_batch_size=2, adapters_off=True).compute_log_prob(batch, False)["log_probs"]
        gathered = gather_full_adapters(engine.module, config)
        # merged reshard sources = this rank's shard of the merged checkpoint
        merged_shard = to_mcore_shard(config, HFCheckpoint(merged_dir).get, tp, pp,
                                      mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank())
        sources = engine.reshard_sources(torch.float32, "cpu")
        source_err = max(float((sources[k] - v.reshape(-1)).abs().max()) for k, v in merged_shard.items())
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        adapters = adapter_parameters(engine.module)
        optimizer_params = [p for opt in engine.torch_optimizers() for g in opt.param_groups for p in g["params"]]
        optimizer_numel = sum(p.numel() for p in optimizer_params)
        from helpers.megatron_tiny_models import sft_loss

        metrics = actor.update_policy(batch, sft_loss, calculate_entropy=True)
        after = dict(engine.module.named_parameters())
        out[name] = {
            "lora_err": float((lora_lp - dense["merged"]).abs().max()),
            "ref_err": float((ref_lp - dense["base"]).abs().max()),
            "lora_vs_base": float((lora_lp - dense["base"]).abs().max()),
            "gather_err": max(float((gathered[k] - v).abs().max()) for k, v in adapter.items()),
            "gather_keys": sorted(gathered) == sorted(adapter),
            "source_err": source_err,
            "frozen_moved": [n for n, p in after.items() if n not in adapters and not torch.equal(p, before[n])],
            "adapters_moved": all(not torch.equal(after[n], before[n]) for n in adapters),
            "adapter_numel": sum(p.numel() for p in adapters.values()),
            # distributed optimizer: each DP rank holds a shard of the adapters' fp32 main params
            "optimizer_numel": optimizer_numel,
            "distopt": distopt,
            "dp": mpu.get_data_parallel_world_size(),
            "base_requires_grad": [n for n, p in after.items() if p.requires_grad and n not in adapters],
            "loss": metrics["loss"],
            "rank": dist.get_rank(),
        }
        destroy_megatron()
    return out


def _fsdp_job(base_dir, merged_dir, adapter):
    from helpers.megatron_tiny_models import sft_loss

    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.fsdp.lora import full_adapters, init_adapters
    from verl.engine.fsdp.parallel import fsdp_mesh
    from verl.engine.lora import LoRASettings, adapter_parameters
    from verl.engine.megatron.engine import OptimConfig
    from verl.engine.roles import Actor

    config = model_config(base_dir)
    batch = padded_batch(batch=4)
    batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:]
    mesh = fsdp_mesh(-1)
    lora = LoRASettings(rank=RANK, alpha=ALPHA, target_modules=("all-linear",))
    engine = FSDPEngine(config, base_dir, mesh, "lm", OptimConfig(lr=1e-2, weight_decay=0.0), lora=lora)
    init_adapters(engine.module, 0, adapter)
    dense = {which: Actor(FSDPEngine(config, path, mesh, "lm"), micro_batch_size=2).compute_log_prob(
        batch, False)["log_probs"] for which, path in (("base", base_dir), ("merged", merged_dir))}
    actor = Actor(engine, micro_batch_size=2)
    lora_lp = actor.compute_log_prob(batch, False)["log_probs"]
    ref_lp = Actor(engine, micro_batch_size=2, adapters_off=True).compute_log_prob(batch, False)["log_probs"]
    gathered = full_adapters(engine.module)
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()  # noqa: E731
    before = {n: full(p).clone() for n, p in engine.module.named_parameters()}
    adapters = adapter_parameters(engine.module)
    optimizer_params = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    metrics = actor.update_policy(batch, sft_loss)
    after = {n: full(p) for n, p in engine.module.named_parameters()}
    return {
        "lora_err": float((lora_lp - dense["merged"]).abs().max()),
        "ref_err": float((ref_lp - dense["base"]).abs().max()),
        "lora_vs_base": float((lora_lp - dense["base"]).abs().max()),
        "gather_err": max(float((gathered[k] - v).abs().max()) for k, v in adapter.items()),
        "gather_keys": sorted(gathered) == sorted(adapter),
        "frozen_moved": [n for n in after if n not in adapters and not torch.equal(after[n], before[n])],
        "adapters_moved": all(not torch.equal(after[n], before[n]) for n in adapters),
        "optimizer_only_adapters": optimizer_params == {id(p) for p in adapters.values()},
        "loss": metrics["loss"],
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = hf_model("qwen2_gqa_tied")
    adapter = full_adapter(model)
    base_dir = save_hf(model, str(root / "base"), sharded=False)
    merged_dir = save_hf(merged_model(model, adapter), str(root / "merged"), sharded=False)
    return model, adapter, base_dir, merged_dir


def _check(result):
    assert result["gather_keys"] and result["gather_err"] == 0.0, result
    assert result["lora_vs_base"] > 100 * TOL, result  # the adapter changes the model: the test can tell
    assert result["lora_err"] < TOL, result
    assert result["ref_err"] < TOL, result
    assert result["frozen_moved"] == [], result
    assert result["adapters_moved"], result


def test_megatron_lora_tp2_pp2_against_oracle(checkpoints):
    _, adapter, base_dir, merged_dir = checkpoints
    per_rank = run_ranks(_megatron_job, 2, base_dir, merged_dir, adapter, timeout_s=240)
    for result in per_rank:
        for name, r in result.items():
            _check(r)
            assert r["source_err"] < 1e-6, (name, r)
            assert r["base_requires_grad"] == [], (name, r)
            share = r["dp"] if r["distopt"] else 1
            assert r["optimizer_numel"] * share == pytest.approx(r["adapter_numel"], abs=share), (name, r)


def test_fsdp_lora_against_oracle(checkpoints):
    _, adapter, base_dir, merged_dir = checkpoints
    for r in run_ranks(_fsdp_job, 2, base_dir, merged_dir, adapter, timeout_s=240):
        _check(r)
        assert r["optimizer_only_adapters"], r


def test_peft_round_trip(checkpoints, tmp_path):
    peft = pytest.importorskip("peft")
    from verl.engine.lora import LoRASettings
    from verl.engine.lora.peft_io import read_adapter, write_adapter

    model, adapter, base_dir, merged_dir = checkpoints
    settings = LoRASettings(rank=RANK, alpha=ALPHA, target_modules=HF_LINEARS)
    out = str(tmp_path / "adapter")
    write_adapter(out, adapter, settings, base_dir)
    assert read_adapter(out, settings, base_dir).keys() == adapter.keys()
    ids = padded_batch(batch=2)["input_ids"]
    with torch.no_grad():
        want = merged_model(model, adapter)(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(hf_model("qwen2_gqa_tied"), out).eval()
        got = loaded(input_ids=ids).logits
    assert float((got - want).abs().max()) < 1e-4
