"""megatron-core GPTModel for Qwen2 / Llama / Qwen3 / Qwen3-MoE, built from the shared HF-style
:class:`ModelConfig`.

Local layer spec (torch or apex norms, megatron's own attention): Qwen2 and Llama are the same
transformer — RMSNorm, RoPE (theta and scaling from the config: ``use_rope_scaling``), SwiGLU MLP without
biases, grouped-query attention — and differ only in the qkv bias, which the config carries. Three heads share
the trunk:
  lm     vocab-parallel output layer (tied to the embedding when the config says so)
  value  critic: one scalar per token
  score  reward model: one scalar per token, read at each sequence's last valid token

Qwen3 adds megatron's ``qk_layernorm``. Qwen3-MoE layers are megatron's MoELayer (local spec: a
SequentialMLP of the rank's experts) with the router HF uses: softmax over all experts, top k
(``moe_router_pre_softmax``) unless ``norm_topk_prob``, where top-k then softmax over the chosen logits is
the same renormalised weights; dense layers (``mlp_only_layers``) come from ``moe_layer_freq``. Tokens
reach their experts through the ``allgather`` dispatcher on CPU (megatron's ``alltoall`` one needs CUDA
streams) and ``alltoall`` on GPU.

A dense block that departs from Llama's (``ModelConfig.block_features``: GeGLU, offset norms in float32, sandwich
norms, sliding-window layers with their own RoPE, an embedding multiplier, soft-capped logits) is built from the same
spec with the modules of ``verl.models.mcore.block``; the activation, the softmax scale and the windows are
TransformerConfig keys.

The TP / PP / EP layout comes from megatron's ``parallel_state`` (initialise it first).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from verl.errors import InputError
from verl.models.config import ModelConfig
from verl.models.rope import inv_freq as rope_inv_freq
from verl.utils.device import is_cuda_available

# Megatron's make_vocab_size_divisible_by default; the padded vocab is a multiple of this times tp.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
HEADS = ("lm", "value", "score")


class ModelLayoutError(InputError):
    """A (tp, pp) the model cannot be split over."""


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp_size
    return -(-vocab_size // multiple) * multiple


# The block features beyond the Llama/Qwen block (ModelConfig.block_features) the builder computes
# (verl.models.mcore.block), each checked against transformers in the Megatron parity tiers.
MEGATRON_BLOCK_FEATURES = ("hidden_act", "norm_weight_offset", "norm_scale_in_float32", "embedding_multiplier",
                           "final_logit_softcapping", "query_pre_attn_scalar", "sliding_rope_theta", "sliding_window",
                           "sliding_layers", "attn_post_norm", "mlp_post_norm")
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def check_megatron_block(config: ModelConfig) -> None:
    """One line for a model whose decoder block the builder cannot make: a block feature outside
    :data:`MEGATRON_BLOCK_FEATURES`, or one of them on an MoE model (its layers are megatron's MoE spec)."""
    features = config.block_features()
    missing = [f for f in features if f not in MEGATRON_BLOCK_FEATURES or config.is_moe]
    if missing:
        raise ModelLayoutError(f"model_type {config.model_type}: the Megatron builder lacks the block features "
                               f"{missing} of its spec{' on an MoE model' if config.is_moe else ''}: use strategy "
                               f"fsdp to train it, the native engine to generate")


def check_parallel_layout(config: ModelConfig, tp_size: int, pp_size: int, ep_size: int = 1,
                          etp_size: int | None = None, world_size: int | None = None) -> None:
    """One clear line for a (tp, pp, ep, etp) that does not divide the model (or the world, when given).
    ``etp_size`` None: megatron's default, the dense tp."""
    etp_size = tp_size if etp_size is None else etp_size
    checks = [
        ("num_attention_heads", config.num_attention_heads, tp_size, "tp"),
        ("num_key_value_heads", config.num_key_value_heads, tp_size, "tp"),
        ("intermediate_size", config.intermediate_size, tp_size, "tp"),
        ("num_hidden_layers", config.num_hidden_layers, pp_size, "pp"),
    ]
    if config.is_moe:
        checks += [("num_experts", config.num_experts, ep_size, "ep"),
                   ("moe_intermediate_size", config.moe_intermediate_size, etp_size, "etp")]
    for key, value, size, what in checks:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ModelLayoutError(f"{what}: expected a positive integer, found {size!r}")
        if value % size:
            raise ModelLayoutError(f"{what}={size}: expected a divisor of {key}={value}, "
                                   f"found remainder {value % size}")
    if not config.is_moe and (ep_size, etp_size) != (1, tp_size):
        raise ModelLayoutError(f"ep={ep_size}, etp={etp_size}: expected ep=1 and etp=tp for a dense "
                               f"{config.model_type} model (it has no experts)")
    if world_size is not None and world_size % (tp_size * pp_size) == 0:  # (the caller names a tp*pp misfit)
        dense_ranks = world_size // pp_size  # tp * dp ranks of one stage; megatron carves ep x etp from them
        if dense_ranks % (ep_size * etp_size):
            raise ModelLayoutError(f"ep*etp={ep_size * etp_size}: expected a divisor of the {dense_ranks} "
                                   f"ranks of a pipeline stage (tp*dp = world {world_size} / pp {pp_size})")


def moe_settings(config: ModelConfig, ep_size: int, etp_size: int, on_gpu: bool) -> dict:
    """megatron's MoE TransformerConfig keys for a Qwen3-MoE config (empty for a dense model)."""
    if not config.is_moe:
        return {}
    return dict(
        num_moe_experts=config.num_experts,
        moe_router_topk=config.num_experts_per_tok,
        moe_ffn_hidden_size=config.moe_intermediate_size,
        moe_layer_freq=[int(config.layer_is_moe(i)) for i in range(config.num_hidden_layers)],
        moe_router_score_function="softmax",
        # HF: softmax over all experts, then top k; renormalised = softmax over the top-k logits.
        moe_router_pre_softmax=not config.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=config.router_aux_loss_coef,
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        moe_grouped_gemm=False,
        # Each router gets a RouterReplay: idle unless the engine hands it a rollout's routing to replay.
        moe_enable_routing_replay=True,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=etp_size,
    )


def _router_gemm_without_te() -> None:
    """megatron-core 0.16.1's router gemm reads ``te_general_gemm``, which its moe_utils binds only when
    Transformer Engine imports (a NameError otherwise, on CPU and on GPU hosts without TE); None selects its
    own torch.mm path."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def transformer_config(config: ModelConfig, tp_size: int, pp_size: int, *,
                       params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                       ep_size: int = 1, etp_size: int | None = None, **overrides):
    """megatron TransformerConfig for ``config``: fusions off on CPU, dropout 0 (RL fine-tuning)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    etp_size = tp_size if etp_size is None else etp_size
    check_megatron_block(config)
    check_parallel_layout(config, tp_size, pp_size, ep_size, etp_size)
    on_gpu = is_cuda_available()
    kwargs = dict(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=ACTIVATIONS[config.hidden_act],
        add_bias_linear=False,
        add_qkv_bias=config.attention_bias,
        qk_layernorm=config.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # The fused kernels exist only on GPU (apex / TE / CUDA JIT).
        gradient_accumulation_fusion=False,
        bias_activation_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **moe_settings(config, ep_size, etp_size, on_gpu),
        **rope_attention_settings(config),
        **window_settings(config),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def rope_attention_settings(config: ModelConfig) -> dict:
    """The softmax scale: the config's (head_dim ** -0.5, or query_pre_attn_scalar ** -0.5 where set), times m**2
    where YaRN multiplies cos and sin by an attention factor m on both q and k: megatron's plain RoPE path has no
    such factor (its YaRN module's default differs from transformers'), so it goes into the scale."""
    _, scale = rope_inv_freq(config.head_dim, config.rope_theta, config.rope)
    softmax_scale = config.attention_scale * scale * scale
    return {} if softmax_scale == config.head_dim ** -0.5 else {"softmax_scale": softmax_scale}


def window_settings(config: ModelConfig) -> dict:
    """Sliding-window layers in megatron's terms: ``window_size`` (left, right) = (window - 1, 0), a query sees
    itself and the window - 1 keys before it, as HF's ``sliding_window``; ``window_attn_skip_freq`` lists per
    layer whether it slides."""
    if not config.sliding_layers:
        return {}
    return {"window_size": (config.sliding_window - 1, 0),
            "window_attn_skip_freq": [int(i in config.sliding_layers) for i in range(config.num_hidden_layers)]}


def use_rope_scaling(model, config: ModelConfig) -> None:
    """Replace megatron's plain RoPE frequencies with the scaled ones of ``config.rope`` (the shared function
    every engine uses: megatron's own llama3 path hard-codes its defaults and its YaRN differs in the
    attention factor), before the first forward caches any table."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if config.rope is None or rotary is None:
        return
    inv_freq, _ = rope_inv_freq(config.head_dim, config.rope_theta, config.rope, device=rotary.inv_freq.device)
    if inv_freq.shape != rotary.inv_freq.shape:
        raise ValueError(f"rotary inv_freq: expected shape {tuple(rotary.inv_freq.shape)}, "
                         f"found {tuple(inv_freq.shape)}")
    rotary.inv_freq = inv_freq.to(rotary.inv_freq.dtype)
    rotary.forward.cache_clear()


class ValueHead(torch.nn.Module):
    """Scalar head on the final hidden states, replicated on every TP rank.

    Called the way GPTModel calls its output layer, and like megatron's ColumnParallelLinear it returns
    every position of the sequence: under sequence parallelism each TP rank holds [s/tp, b, h] of the final
    hidden states, so the [s/tp, b, 1] scores are all-gathered along the sequence (gathering the scalars
    moves 1/h of what gathering the hidden states would). megatron's ``output_layer.weight`` name is kept
    so the critic checkpoint reads like verl's (HF ``score.weight``).
    """

    def __init__(self, hidden_size: int, init_std: float, params_dtype: torch.dtype, seed: int = 0,
                 sequence_parallel: bool = False):
        super().__init__()
        # A fixed generator makes the replicas identical on every TP rank without a broadcast.
        generator = torch.Generator().manual_seed(seed)
        weight = torch.empty(1, hidden_size, dtype=torch.float32).normal_(0.0, init_std, generator=generator)
        self.weight = torch.nn.Parameter(weight.to(params_dtype))
        # Read by GPTModel's inference path, as on its own output layer.
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            # Each TP rank's gradient covers its own sequence shard only; megatron's finalize_model_grads
            # sums the grads of params tagged so over TP (as for the sequence-parallel norms), which keeps
            # the replicas equal.
            self.weight.sequence_parallel = True

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        """[s (/tp under sequence parallelism), b, h] -> ([s, b, 1], None)."""
        scores = F.linear(hidden_states, self.weight)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # Backward: every TP rank computes the same loss over the whole sequence, so its gradient
            # for the gathered scores is complete; each keeps its own shard (a split, not a reduce-scatter).
            scores = gather_from_sequence_parallel_region(scores, tensor_parallel_output_grad=False)
        return scores, None


def build_gpt_model(config: ModelConfig, head: str = "lm", *, params_dtype: torch.dtype = torch.float32,
                    sequence_parallel: bool = False, pre_process: bool | None = None,
                    post_process: bool | None = None, **config_overrides):
    """This rank's GPTModel stage for ``config`` under the initialised megatron parallel state."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from verl.models.mcore.attention import use_sdpa_core_attention
    from verl.models.mcore.block import add_output_hooks, block_layer_spec
    from verl.models.mcore.cpu_linear import use_onednn_linears

    if head not in HEADS:
        raise ValueError(f"model head: expected one of {HEADS}, found {head!r}")
    tp_size = mpu.get_tensor_model_parallel_world_size()
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    # A dense model (a critic or reward model beside an MoE actor) ignores the process's expert groups.
    ep_size, etp_size = ((mpu.get_expert_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size())
                         if config.is_moe else (1, tp_size))
    tf_config = transformer_config(config, tp_size, pp_size, params_dtype=params_dtype,
                                   sequence_parallel=sequence_parallel, ep_size=ep_size, etp_size=etp_size,
                                   **config_overrides)
    if config.is_moe:
        _router_gemm_without_te()
        # Per-layer specs: MoE layers and moe_layer_freq's dense ones, local (non-TE) modules.
        layer_spec = get_gpt_decoder_block_spec(tf_config, use_transformer_engine=False, normalization="RMSNorm")
        use_sdpa_core_attention(layer_spec)
    else:
        layer_spec, final_norm = block_layer_spec(
            config, get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_norm))
        use_sdpa_core_attention(layer_spec)
        if final_norm is not None:  # this stage's layers and the model's own final norm
            layer_spec = TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(tf_config),
                                                    layer_norm=final_norm)
    pre_process = mpu.is_pipeline_first_stage() if pre_process is None else pre_process
    post_process = mpu.is_pipeline_last_stage() if post_process is None else post_process
    tied = head == "lm" and config.tie_word_embeddings
    model = GPTModel(
        config=tf_config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(config.vocab_size, tp_size),
        max_sequence_length=config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=config.rope_theta,
    )
    use_rope_scaling(model, config)
    if head != "lm" and post_process:
        model.output_layer = ValueHead(config.hidden_size, tf_config.init_method_std, params_dtype,
                                       sequence_parallel=tf_config.sequence_parallel)
    model.verl_head = head
    add_output_hooks(model, config, head)
    use_onednn_linears(model)  # fp32 on CPU
    return model
