"""Tiny random Qwen3, Qwen3-MoE and Mixtral checkpoints (transformers' own classes are the oracle).

"qwen3_moe" mixes layer kinds: layer 1 is a dense MLP (``mlp_only_layers``), the others route each token
to 2 of 4 experts with the top-k weights renormalised; "qwen3_moe_raw" keeps HF's default
``norm_topk_prob=False``; "mixtral" is the other MoE family (every layer sparse, experts of
``intermediate_size``, no q/k norms). A wide init (0.2) keeps both the router's top-k and the greedy tokens away
from ties that another fp32 summation order could flip.
"""

from __future__ import annotations

import torch

VOCAB = 200  # not a multiple of 64 or 128: both vocab paddings are exercised

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
              initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
              pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.01)

CONFIGS = {
    "qwen3": dict(model_type="qwen3", **COMMON),
    "qwen3_moe": dict(model_type="qwen3_moe", **COMMON, **MOE, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen3_moe_raw": dict(model_type="qwen3_moe", **COMMON, **MOE, norm_topk_prob=False),
    # Mixtral: every layer sparse, experts intermediate_size (16) wide, no q/k norms.
    "mixtral": dict(model_type="mixtral", **dict(COMMON, intermediate_size=16), num_local_experts=4,
                    num_experts_per_tok=2, router_aux_loss_coef=0.01),
}


def hf_model(name: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(CONFIGS[name])
    config = AutoConfig.for_model(kwargs.pop("model_type"), attn_implementation="eager", **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits norms to ones; random ones make a swapped q/k norm visible
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_model(name: str, path, seed: int = 0):
    model = hf_model(name, seed)
    model.save_pretrained(str(path))
    return model


def hf_logits_with_routing(model, input_ids, attention_mask, position_ids, routed):
    """HF logits [B, S, V] with every MoE layer's top-k replaced by ``routed`` [B, S, MoE layers, k] (the
    routing-replay oracle): the router still weights the forced experts by its own softmax (renormalised over
    them when norm_topk_prob), as megatron's replay and transformers' router do for their own choices."""
    import torch.nn.functional as F

    routers = [getattr(layer, "mlp", getattr(layer, "block_sparse_moe", None)).gate for layer in model.model.layers
               if hasattr(getattr(layer, "mlp", getattr(layer, "block_sparse_moe", None)), "gate")]
    originals = [r.forward for r in routers]

    def forced(router, indices):
        def forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden_states, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            chosen = indices.reshape(-1, indices.shape[-1]).long()
            weights = probs.gather(1, chosen)
            if router.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return forward

    try:
        for i, router in enumerate(routers):
            router.forward = forced(router, routed[:, :, i])
        with torch.no_grad():
            return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits.float()
    finally:
        for router, original in zip(routers, originals, strict=True):
            router.forward = original


def hf_routing(model, input_ids, attention_mask, position_ids):
    """The experts HF's own routers choose [B, S, MoE layers, k] for a batch (teacher-forced)."""
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    output_router_logits=True)
    B, S = input_ids.shape
    return torch.stack([logits.float().softmax(-1).topk(k, dim=-1).indices.view(B, S, k)
                        for logits in out.router_logits], dim=2)
