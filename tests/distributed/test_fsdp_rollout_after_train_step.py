"""FSDP -> native rollout through the 3D-HybridEngine, before and after an optimizer step.

2 gloo ranks, fp32: an FSDP2 actor (Qwen2 tied / Llama untied, every parameter Shard(0) over both ranks,
uneven shards included) and a native rollout engine created once, at rollout TP 1 (each rank all-gathers the
other's shards into its full rollout model) and TP 2 (each rank receives only the rows and columns of its
rollout shard it does not hold). The oracle is transformers' own greedy decoding of the FSDP model's full
weights (``full_tensor`` per parameter); the step must change at least one greedy choice.
"""

import pytest
import torch
from helpers.tiny_models import left_pad, save_tiny_model
from train_step_reshard import BUCKET_BYTES, LR, NEW_TOKENS, PROMPTS, _native_greedy, nll_loss, training_batch

from verl.launcher.spawn import run_ranks

pytestmark = pytest.mark.distributed

CASES = {  # name -> (model, rollout tp)
    "qwen2 fsdp2 -> rollout tp1": ("qwen2", 1),
    "qwen2 fsdp2 -> rollout tp2": ("qwen2", 2),
    "llama fsdp2 -> rollout tp1": ("llama", 1),
    "llama fsdp2 -> rollout tp2": ("llama", 2),
}


def _transformers_greedy(engine, hf_dir):
    """Greedy ids of transformers' model holding the FSDP model's full weights (cache-free argmax)."""
    from transformers import AutoModelForCausalLM

    from verl.engine.fsdp.model import hf_model_config

    full = {n: p.full_tensor().detach() for n, p in engine.module.named_parameters()}
    model = AutoModelForCausalLM.from_config(hf_model_config(hf_dir)).eval()
    missing, _ = model.load_state_dict(full, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing  # tied: lm_head is the embedding
    ids, mask = left_pad(PROMPTS)
    out = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
            out.append(token)
    return torch.cat(out, 1).tolist()


def _job(cases):
    import torch.distributed as dist

    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.fsdp.parallel import fsdp_mesh
    from verl.engine.megatron.engine import OptimConfig
    from verl.engine.roles import Actor
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.hybrid_engine import HybridEngine, rollout_tp_process_group
    from verl.hybrid_engine.layouts import FSDPLayout
    from verl.models.config import ModelConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fsdp_mesh(-1)
    results = {}
    for name, (hf_dir, rollout_tp) in cases.items():
        config = ModelConfig.from_pretrained(hf_dir)
        engine = FSDPEngine(config, hf_dir, mesh, "lm", OptimConfig(lr=LR, weight_decay=0.0, clip_grad=0.0))
        training = FSDPLayout(shard=world)
        groups = derive_groups(training, rollout_tp)
        _, _, tp_group = rollout_tp_process_group(groups, rank)
        rollout = NativeRollout(config, tp_group=tp_group, dtype=torch.float32)
        hybrid = HybridEngine(engine, rollout, config, training, rollout_tp, BUCKET_BYTES, "float32")
        result = {"case": groups.case}
        stats = hybrid.to_rollout()
        result["received_bytes"] = stats.get("perf/reshard_bytes")
        result["native_before"] = _native_greedy(rollout)
        hybrid.to_training()
        result["oracle_before"] = _transformers_greedy(engine, hf_dir)
        batch = training_batch(config.vocab_size)
        share = batch["input_ids"].shape[0] // world
        metrics = Actor(engine, micro_batch_size=share).update_policy(
            {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}, nll_loss, calculate_entropy=False)
        result["update_successful"] = metrics["update_successful"]
        buffer_before = rollout.weight_buffer()
        hybrid.to_rollout()
        result["same_rollout_buffer"] = rollout.weight_buffer() is buffer_before
        result["native_after"] = _native_greedy(rollout)
        hybrid.to_training()
        result["oracle_after"] = _transformers_greedy(engine, hf_dir)
        results[name] = result
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_after_train_step")
    hf_dirs = {kind: save_tiny_model(kind, str(root / kind), seed=3) for kind in ("qwen2", "llama")}
    cases = {name: (hf_dirs[kind], rollout_tp) for name, (kind, rollout_tp) in CASES.items()}
    return run_ranks(_job, 2, cases, timeout_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_native_greedy_equals_fsdp_greedy_after_a_train_step_and_reshard(ranks, case):
    for rank, results in enumerate(ranks):
        r = results[case]
        assert r["update_successful"], f"rank {rank}: the optimizer step did not run"
        assert r["same_rollout_buffer"], f"rank {rank}: the reshard did not write the engine's own buffer"
        assert r["received_bytes"] > 0, f"rank {rank}: nothing moved between the FSDP shards"
        assert r["native_before"] == r["oracle_before"], f"rank {rank}: initial reshard"
        assert r["oracle_after"] != r["oracle_before"], f"rank {rank}: the step changed no greedy choice"
        assert r["native_after"] == r["oracle_after"], f"rank {rank}: reshard after the step"
