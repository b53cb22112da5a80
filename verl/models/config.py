"""The HF-style model config every component shares (Megatron builder, reshard planner, rollout).

Only the decoder-only families that have a model spec (``verl.models.spec``: Qwen2, Llama, Qwen3,
Qwen3-MoE, Mixtral, Gemma 3) are accepted. Each family's spec reads its HF config.json (``ModelSpec.read_hf_config``:
RoPE, biases, q/k norm, the experts, the block fields); the config is validated once, at load, with messages that
name the key.

Mixture of experts: ``num_experts`` routed experts of ``moe_intermediate_size`` each, the top
``num_experts_per_tok`` chosen per token from a softmax over all experts (renormalised over the chosen
ones when ``norm_topk_prob``); ``moe_layers`` lists the sparse layers, the others keep the SwiGLU MLP of
``intermediate_size`` (which layers are sparse is the family's rule, in its spec).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.models.hf_io import read_config
from verl.models.rope import RopeScaling
from verl.models.spec.base import ModelConfigError
from verl.models.spec.registry import UnknownModelTypeError, model_spec, model_types
from verl.utils.checkpoint import CheckpointError

__all__ = ["HIDDEN_ACTS", "POST_NORM_ROLES", "ModelConfig", "ModelConfigError"]

HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
# Spec roles of the norms after the attention and the MLP (before their residual adds: "sandwich" norms).
POST_NORM_ROLES = ("attn_post_norm", "mlp_post_norm")
# The fields whose values other than these make a block other than Llama's (see ModelConfig.block_features).
_LLAMA_BLOCK = {"hidden_act": "silu", "norm_weight_offset": 0.0, "norm_scale_in_float32": False,
                "embedding_multiplier": 1.0, "final_logit_softcapping": 0.0,
                "sliding_rope_theta": 0.0}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool  # qkv bias (the family's spec reads it: always on for Qwen2)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    num_experts: int = 0   # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    rope: RopeScaling | None = None  # RoPE scaling (verl.models.rope); None: plain RoPE of rope_theta
    # The block's shape beyond Llama's; the defaults are the Llama/Qwen block.
    # Engines read these fields (and the spec's roles, e.g. the post-norms), never the model_type.
    hidden_act: str = "silu"                # the gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    norm_weight_offset: float = 0.0         # RMSNorm scales by (offset + weight): 1 for a stored w - 1
    norm_scale_in_float32: bool = False     # RMSNorm scales in float32 and casts after, not cast-then-scale
    embedding_multiplier: float = 1.0       # the embedding rows times this (cast to the weights' dtype): sqrt(hidden)
    query_pre_attn_scalar: float = 0.0      # attention scores scaled by this ** -0.5; 0: by head_dim ** -0.5
    final_logit_softcapping: float = 0.0    # logits -> c * tanh(logits / c); 0: none
    sliding_window: int = 0                 # the sliding layers' window: a token sees the last `window` positions
    sliding_layers: tuple[int, ...] = ()    # the layers with sliding-window attention (the others: full)
    sliding_rope_theta: float = 0.0         # the sliding layers' plain RoPE base; 0: rope_theta / rope as the others

    def __post_init__(self):
        if self.model_type not in model_types():  # the live registry: a registered family counts
            raise ModelConfigError(f"model_type: expected one of {model_types()}, found {self.model_type!r}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{key}: expected a positive integer, found {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_key_value_heads: expected a divisor of num_attention_heads="
                f"{self.num_attention_heads}, found {self.num_key_value_heads}"
            )
        if self.num_experts:
            for key in ("num_experts_per_tok", "moe_intermediate_size"):
                value = getattr(self, key)
                if not isinstance(value, int) or value <= 0:
                    raise ModelConfigError(f"{key}: expected a positive integer for an MoE model, found {value!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ModelConfigError(f"num_experts_per_tok: expected at most num_experts={self.num_experts}, "
                                       f"found {self.num_experts_per_tok}")
            self._check_layer_indices("moe layers", self.moe_layers)
        if self.hidden_act not in HIDDEN_ACTS:
            raise ModelConfigError(f"hidden_act: expected one of {HIDDEN_ACTS}, found {self.hidden_act!r}")
        for key in ("query_pre_attn_scalar", "final_logit_softcapping",
                    "sliding_rope_theta"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ModelConfigError(f"{key}: expected a number >= 0 (0: unset), found {value!r}")
        if self.sliding_layers:
            if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
                raise ModelConfigError(f"sliding_window: expected a positive integer for the sliding layers "
                                       f"{list(self.sliding_layers)}, found {self.sliding_window!r}")
            self._check_layer_indices("sliding layers", self.sliding_layers)

    def _check_layer_indices(self, what: str, layers) -> None:
        bad = [i for i in layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ModelConfigError(f"{what}: expected indices below num_hidden_layers={self.num_hidden_layers}, "
                                   f"found {bad}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    def layer_is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) has routed experts instead of the dense MLP."""
        return layer in self.moe_layers

    def layer_window(self, layer: int) -> int:
        """The attention window of decoder layer ``layer``: a token attends to the keys less than this many
        positions back (itself included); 0: every earlier key (full attention)."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def layer_rope_theta(self, layer: int) -> tuple[float, RopeScaling | None]:
        """The RoPE base and scaling of decoder layer ``layer`` (a sliding layer may have its own plain base)."""
        if self.sliding_rope_theta and layer in self.sliding_layers:
            return self.sliding_rope_theta, None
        return self.rope_theta, self.rope

    @property
    def attention_scale(self) -> float:
        """What the attention scores q.k are multiplied by."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def block_features(self) -> tuple[str, ...]:
        """The ways this model's decoder block departs from the Llama/Qwen block (RMSNorm, SwiGLU, full causal
        attention scaled by head_dim ** -0.5, one RoPE): the config fields and spec roles an engine that computes
        only that block lacks, so it can refuse the model in one line naming them."""
        out = [key for key, default in _LLAMA_BLOCK.items() if getattr(self, key) != default]
        if self.query_pre_attn_scalar and self.query_pre_attn_scalar != self.head_dim:
            out.append("query_pre_attn_scalar")
        if self.sliding_layers:
            out += ["sliding_window", "sliding_layers"]
        roles = {p.role for p in model_spec(self.model_type).layer}
        out += sorted(roles & set(POST_NORM_ROLES))
        return tuple(out)

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """From an HF config.json's values; the family's spec reads them (``ModelSpec.read_hf_config``)."""
        model_type = cfg.get("model_type")
        try:
            spec = model_spec(model_type)
        except UnknownModelTypeError as err:
            raise ModelConfigError(str(err)) from None
        try:
            return cls(model_type=model_type, **spec.read_hf_config(cfg))
        except KeyError as exc:
            raise ModelConfigError(f"model config: expected the key {exc.args[0]!r}, found it missing") from None

    def to_fields(self) -> dict[str, Any]:
        """The config as plain JSON values (a manifest, a message to spawned ranks); ``from_fields`` inverts it."""
        return {**dataclasses.asdict(self), "moe_layers": list(self.moe_layers),  # (asdict: rope a plain dict)
                "sliding_layers": list(self.sliding_layers)}

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> ModelConfig:
        rope = fields.get("rope")
        return cls(**{**fields, "moe_layers": tuple(fields.get("moe_layers", ())),
                      "sliding_layers": tuple(fields.get("sliding_layers", ())),
                      "rope": RopeScaling(**rope) if isinstance(rope, Mapping) else rope})

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        """Load from an HF model directory or a config.json path."""
        try:
            cfg = read_config(path)
        except CheckpointError as err:
            raise ModelConfigError(f"model config: {err}") from None
        return cls.from_dict(cfg)
