"""dist_checkpointing save / load on 4 gloo ranks: exact resume (distributed optimizer), a (2,2)
checkpoint loaded at (1,1), and a clear error for a checkpoint with a missing file."""

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import (  # noqa: E402
    RESPONSE,
    hf_model,
    model_config,
    padded_batch,
    save_hf,
    sft_loss,  # noqa: E402
)
from helpers.tolerance import decoder_depth, forward_tolerance  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

STEPS = 6


def _full_logits(engine):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from verl.engine.padding import restore

    def output_fn(logits, aligned_ids, shifts, micro_batch):
        return {"logits": restore(gather_from_tensor_model_parallel_region(logits), shifts)}

    return output_fn


def _checkpoint_job(hf_dir, ckpt_root, batch):
    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.checkpoint import load_checkpoint, save_checkpoint
    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    config = model_config(hf_dir)
    optim = OptimConfig(lr=3e-3, weight_decay=0.01, lr_warmup_steps=2, total_training_steps=STEPS,
                        lr_decay_style="cosine", use_distributed_optimizer=True)

    def actor(tp, pp, load_hf=True, with_optim=True):
        initialize_megatron(tp, pp, seed=11)
        engine = MegatronEngine(config, optim=optim if with_optim else None)
        if load_hf:
            load_hf_into_model(engine.module, config, HFCheckpoint(hf_dir).get)
        share = batch["input_ids"].size(0) // mpu.get_data_parallel_world_size()
        rank = mpu.get_data_parallel_rank()
        return engine, Actor(engine, 2), {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}

    result = {}
    engine, worker, data = actor(2, 1)
    result["continuous"] = [worker.update_policy(data, sft_loss)["loss"] for _ in range(STEPS)]
    destroy_megatron()

    engine, worker, data = actor(2, 1)
    first = [worker.update_policy(data, sft_loss)["loss"] for _ in range(STEPS // 2)]
    save_checkpoint(engine, os.path.join(ckpt_root, "tp2_dp2"), iteration=STEPS // 2)
    destroy_megatron()
    engine, worker, data = actor(2, 1, load_hf=False)
    result["resumed_iteration"] = load_checkpoint(engine, os.path.join(ckpt_root, "tp2_dp2"))
    result["resumed"] = first + [worker.update_policy(data, sft_loss)["loss"] for _ in range(STEPS - STEPS // 2)]
    destroy_megatron()

    # Saved before its first step (an actor during trainer.critic_warmup): a fresh optimizer on load.
    engine, worker, data = actor(2, 1)
    save_checkpoint(engine, os.path.join(ckpt_root, "never_stepped"), iteration=0)
    destroy_megatron()
    engine, worker, data = actor(2, 1, load_hf=False)
    result["never_stepped_iteration"] = load_checkpoint(engine, os.path.join(ckpt_root, "never_stepped"))
    result["never_stepped"] = [worker.update_policy(data, sft_loss)["loss"] for _ in range(STEPS)]
    destroy_megatron()

    engine, worker, data = actor(2, 2)
    worker.update_policy(data, sft_loss)
    result["logits_2x2"] = engine.forward(batch, 2, _full_logits(engine))["logits"]
    save_checkpoint(engine, os.path.join(ckpt_root, "tp2_pp2"), iteration=1)
    destroy_megatron()
    engine, worker, data = actor(1, 1, load_hf=False, with_optim=False)
    load_checkpoint(engine, os.path.join(ckpt_root, "tp2_pp2"), with_optimizer=False)
    result["logits_1x1"] = engine.forward(batch, 2, _full_logits(engine))["logits"]
    result["attention_mask"] = batch["attention_mask"]
    destroy_megatron()
    return result


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory):
    hf_dir = save_hf(hf_model("llama_gqa_untied", seed=8), str(tmp_path_factory.mktemp("hf")), sharded=False)
    ckpt_root = str(tmp_path_factory.mktemp("ckpt"))
    batch = padded_batch(seed=4, batch=8)
    batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:]
    return ckpt_root, run_ranks(_checkpoint_job, 4, hf_dir, ckpt_root, batch, timeout_s=300)


def test_resume_reproduces_the_loss_curve_exactly(checkpoint_run):
    result = checkpoint_run[1][0]
    assert result["resumed_iteration"] == STEPS // 2
    assert result["resumed"] == result["continuous"], (result["resumed"], result["continuous"])


def test_a_checkpoint_saved_before_the_first_step_resumes_exactly(checkpoint_run):
    ckpt_root, results = checkpoint_run
    assert results[0]["never_stepped_iteration"] == 0
    assert results[0]["never_stepped"] == results[0]["continuous"]
    with open(os.path.join(ckpt_root, "never_stepped", "verl_checkpoint.json")) as fh:
        manifest = json.load(fh)
    assert manifest["fresh_optimizer"] and not manifest["with_optimizer"]


def test_tp2_pp2_checkpoint_loads_at_tp1_pp1(checkpoint_run):
    result = checkpoint_run[1][0]
    # Valid positions only: at TP1 x PP1 the engine skips the padded columns (PP2 runs the full width).
    valid = result["attention_mask"].bool()
    worst = (result["logits_2x2"][valid] - result["logits_1x1"][valid]).abs().max().item()
    # Same weights, another TP x PP split: only the fp32 summation order differs (widest reduction: the
    # MLP's 64 terms; 4 decoder layers; normalised activations of magnitude >= 1 feed every projection).
    scale = max(1.0, result["logits_1x1"][valid].abs().max().item())
    bound = forward_tolerance(torch.float32, width=64, depth=decoder_depth(4), scale=scale)
    assert worst <= bound, f"max |logits(2,2) - logits(1,1) from checkpoint| = {worst:.3e} > {bound:.3e}"


def test_checkpoint_is_atomic_and_complete(checkpoint_run):
    from verl.engine.megatron.checkpoint import MANIFEST, read_manifest

    root = checkpoint_run[0]
    assert sorted(os.listdir(root)) == ["never_stepped", "tp2_dp2", "tp2_pp2"], "no staging directory may remain"
    manifest = read_manifest(os.path.join(root, "tp2_pp2"))
    assert (manifest["tp"], manifest["pp"], manifest["iteration"]) == (2, 2, 1)
    assert MANIFEST not in manifest["files"] and manifest["files"]


def test_missing_file_is_one_clear_error(checkpoint_run, tmp_path):
    from verl.engine.megatron.checkpoint import CheckpointError, read_manifest

    broken = str(tmp_path / "broken")
    shutil.copytree(os.path.join(checkpoint_run[0], "tp2_pp2"), broken)
    victim = read_manifest(broken)["files"][0]
    os.remove(os.path.join(broken, victim))
    with pytest.raises(CheckpointError, match=f"expected file {victim}, found it missing"):
        read_manifest(broken)
