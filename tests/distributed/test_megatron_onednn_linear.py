"""Megatron's linears on oneDNN in fp32 on CPU (verl/models/mcore/cpu_linear.py): at TP 2 (column-parallel
linears all-reduce their input gradient, row-parallel ones all-reduce their output) with tied embeddings and
qkv bias, the model's logits and every parameter's gradient equal megatron's own torch.matmul path within the fp32
bound, oneDNN's GEMM is what ran, and VERL_CPU_GEMM=torch leaves megatron's linears as they are."""

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import SEQ, VOCAB, hf_model, model_config, save_hf  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402


def _linears(module):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _step(model, batch, weights):
    """Logits and every parameter's gradient of one forward + backward, and whether oneDNN's GEMM ran."""
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None)
        (logits * weights).sum().backward()
    ran = {event.key for event in prof.key_averages()}
    return {"logits": logits.detach().clone(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "onednn_ran": "mkldnn::_linear_pointwise" in ran}


def _onednn_job(hf_dir):
    import os

    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.model import build_gpt_model
    from verl.models.mcore.weights import load_hf_into_model

    initialize_megatron(2, 1, seed=1)
    config = model_config(hf_dir)
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    batch = {"input_ids": input_ids, "position_ids": torch.arange(SEQ).expand(3, SEQ)}
    model = build_gpt_model(config)
    load_hf_into_model(model, config, HFCheckpoint(hf_dir).get)
    shard = model.output_layer.output_size_per_partition
    weights = torch.randn(3, SEQ, shard * 2, generator=g)
    weights = weights[..., mpu.get_tensor_model_parallel_rank() * shard:][..., :shard]
    linears = _linears(model)
    patched = [bool(getattr(m._forward_impl, "onednn", False)) for m in linears]
    ours = _step(model, batch, weights)
    for m in linears:
        del m._forward_impl  # megatron's own method again
    theirs = _step(model, batch, weights)
    os.environ["VERL_CPU_GEMM"] = "torch"
    plain = build_gpt_model(config)
    plain_patched = [bool(getattr(m._forward_impl, "onednn", False)) for m in _linears(plain)]
    del os.environ["VERL_CPU_GEMM"]
    destroy_megatron()
    return {"patched": patched, "plain_patched": plain_patched, "ours": ours, "theirs": theirs}


def test_megatron_linears_on_onednn_equal_megatrons_own_at_tp2(tmp_path):
    hf_dir = save_hf(hf_model("qwen2_gqa_tied"), str(tmp_path / "hf"), sharded=False)
    results = run_ranks(_onednn_job, 2, hf_dir, timeout_s=240)
    # Each GEMM's two fp32 evaluations differ by at most 2 k u of |A| |B| (k <= 64 here: hidden 32, MLP 64,
    # 36 tokens); through 4 layers' forward and backward (~30 chained GEMMs) that gives 30 * 2 * 64 * u relative to
    # each tensor's scale.
    tol = 30 * 2 * 64 * torch.finfo(torch.float32).eps / 2
    for rank in results:
        assert rank["patched"] and all(rank["patched"]), "every megatron linear takes oneDNN's path"
        assert not any(rank["plain_patched"]), "VERL_CPU_GEMM=torch keeps megatron's own"
        ours, theirs = rank["ours"], rank["theirs"]
        assert ours["onednn_ran"] and not theirs["onednn_ran"]
        scale = theirs["logits"].abs().max()
        assert (ours["logits"] - theirs["logits"]).abs().max() <= tol * scale
        assert ours["grads"].keys() == theirs["grads"].keys() and len(ours["grads"]) > 10
        for name, want in theirs["grads"].items():
            got = ours["grads"][name]
            assert (got - want).abs().max() <= tol * want.abs().max(), name
