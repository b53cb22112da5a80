"""The HF-style model config every component shares (Megatron builder, reshard planner, rollout).

Only the decoder-only families that have a model spec (``verl.models.spec``: Qwen2, Llama, Qwen3,
Qwen3-MoE, Mixtral) are accepted; the config is validated once, at load, with messages that name the key.

Mixture of experts (Qwen3-MoE): ``num_experts`` routed experts of ``moe_intermediate_size`` each, the
top ``num_experts_per_tok`` chosen per token from a softmax over all experts (renormalised over the
chosen ones when ``norm_topk_prob``). Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0`` (transformers' rule); dense layers keep the SwiGLU MLP of
``intermediate_size``. ``moe_layers`` lists the sparse ones. Mixtral: every layer sparse, experts of
``intermediate_size``, the top-k weights always renormalised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.errors import InputError
from verl.models.hf_io import read_config
from verl.models.spec.registry import model_types
from verl.utils.checkpoint import CheckpointError

SUPPORTED_MODEL_TYPES = model_types()


class ModelConfigError(InputError):
    """An HF config.json the project cannot build a model from."""


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
    attention_bias: bool  # qkv bias: always on for Qwen2, `attention_bias` for Llama
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    num_experts: int = 0   # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type: expected one of {SUPPORTED_MODEL_TYPES}, found {self.model_type!r}"
            )
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
            bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ModelConfigError(f"moe layers: expected indices below num_hidden_layers="
                                       f"{self.num_hidden_layers}, found {bad}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    def layer_is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) has routed experts instead of the dense MLP."""
        return layer in self.moe_layers

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
        model_type = cfg.get("model_type")
        # transformers >= 5 writes RoPE settings under `rope_parameters`; older configs at top level.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelConfigError(f"rope_parameters.rope_type: expected 'default' (RoPE scaling is not supported), "
                                   f"found {rope_type!r}")
        if model_type == "mixtral" and cfg.get("sliding_window") is not None:
            raise ModelConfigError(f"sliding_window: expected null for mixtral (sliding-window attention is not "
                                   f"supported), found {cfg['sliding_window']}")
        if model_type == "qwen3_moe" and cfg.get("shared_expert_intermediate_size"):
            raise ModelConfigError("shared_expert_intermediate_size: expected 0 for qwen3_moe (no shared expert), "
                                   f"found {cfg['shared_expert_intermediate_size']}")
        try:
            heads = int(cfg["num_attention_heads"])
            moe = {}
            if model_type == "qwen3_moe":
                layers = int(cfg["num_hidden_layers"])
                step = int(cfg.get("decoder_sparse_step", 1))
                if step <= 0:
                    raise ModelConfigError(f"decoder_sparse_step: expected a positive integer, found {step}")
                dense = set(cfg.get("mlp_only_layers") or ())
                moe = dict(
                    num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
                    router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
                )
                if moe["num_experts"] <= 0:
                    raise ModelConfigError(f"num_experts: expected a positive integer for qwen3_moe, "
                                           f"found {cfg.get('num_experts')!r}")
            elif model_type == "mixtral":  # every layer sparse; the experts are intermediate_size wide
                moe = dict(
                    num_experts=int(cfg["num_local_experts"]),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]),
                    norm_topk_prob=True,
                    moe_layers=tuple(range(int(cfg["num_hidden_layers"]))),
                    router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
                )
            hidden = int(cfg["hidden_size"])
            head_dim = cfg.get("head_dim") or hidden // heads
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                **moe,
            )
        except KeyError as exc:
            raise ModelConfigError(f"model config: expected the key {exc.args[0]!r}, found it missing") from None

    def to_fields(self) -> dict[str, Any]:
        """The config as plain JSON values (a manifest, a message to spawned ranks); ``from_fields`` inverts it."""
        return {**dataclasses.asdict(self), "moe_layers": list(self.moe_layers)}

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> ModelConfig:
        return cls(**{**fields, "moe_layers": tuple(fields.get("moe_layers", ()))})

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        """Load from an HF model directory or a config.json path."""
        try:
            cfg = read_config(path)
        except CheckpointError as err:
            raise ModelConfigError(f"model config: {err}") from None
        return cls.from_dict(cfg)
