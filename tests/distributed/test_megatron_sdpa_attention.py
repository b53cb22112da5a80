"""megatron's core attention through torch's scaled_dot_product_attention (verl/models/mcore/attention.py) against
megatron's own local DotProductAttention: the same outputs on every real token and the same gradients, with GQA
(3 query heads per KV head), a batch of the engine's left-aligned rows (right padding, one row all padding) and
the TP1 layout; and every layer of the dense and the MoE specs gets it."""

import pytest
import torch

pytest.importorskip("megatron.core")

from verl.launcher.spawn import run_ranks  # noqa: E402

S, B, HEADS, GROUPS, HN = 12, 3, 6, 2, 8


def _attention_job():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl.engine.megatron.padding import attention_mask_4d
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.models.mcore.attention import SDPACoreAttention, use_sdpa_core_attention

    initialize_megatron(1, 1, seed=0)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HN, attention_dropout=0.0,
                               use_cpu_initialization=True, masked_softmax_fusion=False)
    ours = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    theirs = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    valid = torch.zeros(B, S, dtype=torch.bool)
    valid[0, :] = True
    valid[1, :7] = True  # right padding: the engine left-aligns every row
    mask = attention_mask_4d(valid.long())  # row 2: all padding
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, B, h, HN, generator=g, dtype=torch.float64).float().requires_grad_()
               for h in (HEADS, GROUPS, GROUPS))
    real = valid.T[:, :, None]  # [S, B, 1]
    weights = torch.randn(S, B, HEADS * HN, generator=g) * real  # a loss on real tokens only
    out = {}
    for name, module in (("sdpa", ours), ("local", theirs)):
        for t in (q, k, v):
            t.grad = None
        y = module(q, k, v, mask)
        (y * weights).sum().backward()
        out[name] = {"y": (y * real).detach(), "finite": bool(torch.isfinite(y).all()),
                     "grads": [t.grad.clone() for t in (q, k, v)]}
    dense = get_gpt_layer_local_spec(normalization="RMSNorm")
    use_sdpa_core_attention(dense)
    moe_config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=2,
                                   moe_router_topk=2, moe_layer_freq=[0, 1], use_cpu_initialization=True)
    block = get_gpt_decoder_block_spec(moe_config, use_transformer_engine=False, normalization="RMSNorm")
    use_sdpa_core_attention(block)
    kinds = [dense.submodules.self_attention.submodules.core_attention.__name__] + [
        layer.submodules.self_attention.submodules.core_attention.__name__ for layer in block.layer_specs]
    destroy_megatron()
    return {"out": out, "kinds": kinds, "fused": ours._fused(mask, None, None)}


def test_sdpa_core_attention_equals_megatrons_on_real_tokens_with_gqa_and_padding():
    result = run_ranks(_attention_job, 1, timeout_s=120)[0]
    sdpa, local = result["out"]["sdpa"], result["out"]["local"]
    # fp32, softmax over <= 12 keys of 8-wide dot products, then 12-term sums: a few ulps of the outputs' scale
    tol = 1e-5
    assert result["fused"], "the engine's masks must take the fused kernel, or nothing here is tested"
    assert sdpa["finite"], "a fully padded row must not make NaN"
    assert (sdpa["y"] - local["y"]).abs().max() <= tol
    for ours, theirs in zip(sdpa["grads"], local["grads"], strict=True):
        assert (ours - theirs).abs().max() <= tol * max(1.0, float(theirs.abs().max()))
    assert result["kinds"] == ["SDPACoreAttention"] * 3
