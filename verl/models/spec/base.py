"""Model specs: every parameter of an architecture family, written once.

A :class:`ParamSpec` is one logical Megatron parameter: its Megatron state-dict key, the HF tensors
it is made of, how they are fused, and how tensor parallelism splits it in training (Megatron) and
in the rollout (SGLang's layout, which the native engine shares). Names carry ``{layer}``: the
stage-local layer index in Megatron names, the global one in HF and rollout names.

  fusion   NONE     one HF tensor
           QKV      q, k, v stacked on dim 0: Megatron interleaves them per query group
                    ``[q heads of the group; k; v]``, the rollout stacks ``[q; k; v]`` of the rank's heads
                    (KV heads replicated when rollout tp > KV heads)
           GATE_UP  gate, up: every TP rank holds ``[gate shard; up shard]``
           STACKED  (bound rollout params only) one expert parameter of every expert stacked on dim 0,
                    each expert's parts split by ``rollout_tp`` (SGLang's fused-MoE ``w13_weight`` /
                    ``w2_weight``: tensor parallelism inside every expert)
  tp       REPLICATED  whole on every rank
           COLUMN      split on dim 0 (output features)
           ROW         split on dim 1 (input features)
           VOCAB       split on dim 0 after padding the rows (Megatron: to 128*tp, SGLang: to 64)

Layers may differ (``layers``: a parameter of every layer, of the dense-MLP layers only, or of the
mixture-of-experts layers only, as the config's ``moe_layers`` says). An ``expert`` parameter has an
``{expert}`` in its names: Megatron's is the rank's local expert index (``local_experts.{j}``, expert
``ep_rank * E/ep + j``), HF's the global one; the rollout holds every expert of it as one STACKED tensor.

A :class:`ModelSpec` places them on pipeline stages (embedding: first stage; layers: split evenly,
stage ``s`` holds global layers ``[s*L/pp, (s+1)*L/pp)``; final norm and head: last stage) and
enumerates the concrete :class:`Param` list of a ModelConfig. The HF <-> Megatron converters
(``verl.models.mcore.weights``) and the hybrid engine's layouts (``verl.hybrid_engine``) are derived
from it; nothing else names an HF tensor.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from verl.errors import InputError
from verl.models.rope import SCALED_TYPES, RopeScaling, yarn_attention_factor

if TYPE_CHECKING:
    from verl.models.config import ModelConfig

Shape = tuple[int, ...]
HFConfigReader = Callable[[Mapping[str, Any]], dict[str, Any]]


class ModelConfigError(InputError):
    """An HF config.json the project cannot build a model from."""


def read_rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of the RoPE settings (``rope_theta`` and ``rope``, the scaling or None); every
    family reads them here. transformers >= 5 writes them under ``rope_parameters``, older configs at top level
    and in ``rope_scaling`` (which transformers prefers when both are given; so do we)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        # Megatron could rotate a fraction (rotary_percent), but transformers' Llama/Qwen modules (the
        # oracle and the FSDP engine) rotate whole heads, so no engine here could be checked against them.
        raise ModelConfigError(f"partial_rotary_factor: expected 1.0 (the Llama/Qwen families rotate whole "
                               f"heads), found {partial!r}")
    if rope_type == "default":
        return {"rope_theta": theta, "rope": None}
    if rope_type == "dynamic":
        raise ModelConfigError("rope_parameters.rope_type 'dynamic' is not supported: NTK scaling recomputes the "
                               "frequencies from each forward's longest position, so a token's log-prob would "
                               "depend on its batch and a generation's cached keys on earlier steps")
    if rope_type not in SCALED_TYPES:
        raise ModelConfigError(f"rope_parameters.rope_type: expected one of {('default', *SCALED_TYPES)}, "
                               f"found {rope_type!r}")
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    # transformers: a top-level original_max_position_embeddings (Phi-3 style) wins, else the max positions.
    original = int(cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                   or max_positions)
    factor = rope.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_positions / original
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ModelConfigError(f"rope_parameters.factor: expected a positive number for rope_type {rope_type!r}, "
                               f"found {factor!r}")
    factor = float(factor)
    if rope_type == "linear":
        return {"rope_theta": theta, "rope": RopeScaling("linear", factor)}
    if rope_type == "llama3":
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        if low >= high:
            raise ModelConfigError(f"rope_parameters.high_freq_factor: expected more than low_freq_factor={low}, "
                                   f"found {high}")
        return {"rope_theta": theta, "rope": RopeScaling("llama3", factor, original, low_freq_factor=low,
                                                         high_freq_factor=high)}
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor, rope.get("mscale"), rope.get("mscale_all_dim"))
    return {"rope_theta": theta, "rope": RopeScaling(
        "yarn", factor, original, beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)), attention_factor=float(attention_factor))}


def read_rope_by_kind(cfg: Mapping[str, Any], kinds: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Each attention kind's :func:`read_rope` fields: transformers keys ``rope_parameters`` by layer type for
    families whose layers differ (Gemma 3's ``full_attention`` / ``sliding_attention``); a config with one RoPE
    gives it to every kind."""
    rope = cfg.get("rope_parameters") or {}
    return {kind: read_rope({**cfg, "rope_parameters": rope[kind], "rope_scaling": None})
            if isinstance(rope.get(kind), Mapping) else read_rope(cfg) for kind in kinds}


def read_decoder(cfg: Mapping[str, Any], rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ModelConfig fields every decoder family shares (RoPE included: ``rope``, or the config's one RoPE), from
    an HF config.json; a missing required key raises KeyError (``ModelConfig.from_dict`` names it).
    ``attention_bias``: the qkv bias as the config says (families that always have it override it)."""
    rope = read_rope(cfg) if rope is None else rope
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        hidden_act=str(cfg.get("hidden_act") or "silu"),  # the gated MLP's activation (ModelConfig checks it)
        **rope,
    )


def read_moe(cfg: Mapping[str, Any], num_experts: int, moe_intermediate_size: int, norm_topk_prob: bool,
             moe_layers: tuple[int, ...]) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig (each family says where its HF config keeps them)."""
    return dict(num_experts=num_experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=moe_intermediate_size, norm_topk_prob=norm_topk_prob, moe_layers=moe_layers,
                router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)))


class Fusion(enum.Enum):
    NONE = "none"
    QKV = "qkv"
    GATE_UP = "gate_up"
    STACKED = "stacked"


class TP(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"


def always(config: ModelConfig) -> bool:
    return True


ALL_LAYERS, DENSE_LAYERS, MOE_LAYERS = "all", "dense", "moe"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One logical Megatron parameter of an architecture (names with ``{layer}``)."""

    role: str                  # architecture-neutral key engines look parameters up by ("qkv", "attn_out", ...)
    mcore: str                 # Megatron GPTModel (local spec) state-dict key
    hf: tuple[str, ...]        # the HF tensors it is made of, stacked on dim 0 in this order
    shapes: Callable[[ModelConfig], tuple[Shape, ...]]  # each HF tensor's shape
    train_tp: TP
    rollout: str | None        # the rollout engine's parameter name; None: the rollout does not hold it
    rollout_tp: TP
    fusion: Fusion = Fusion.NONE
    present: Callable[[ModelConfig], bool] = always  # whether a config has it (e.g. the qkv bias)
    layers: str = ALL_LAYERS   # which layers hold it: ALL_LAYERS, DENSE_LAYERS (MLP) or MOE_LAYERS
    expert: bool = False       # one per routed expert: names carry {expert}

    def __post_init__(self):
        if len(self.hf) != {Fusion.NONE: 1, Fusion.QKV: 3, Fusion.GATE_UP: 2}[self.fusion]:
            raise ValueError(f"{self.mcore}: expected as many HF tensors as {self.fusion} fuses, found {self.hf}")
        if self.layers not in (ALL_LAYERS, DENSE_LAYERS, MOE_LAYERS):
            raise ValueError(f"{self.mcore}: expected layers in {(ALL_LAYERS, DENSE_LAYERS, MOE_LAYERS)}, "
                             f"found {self.layers!r}")
        if self.expert and (self.layers != MOE_LAYERS or "{expert}" not in self.mcore):
            raise ValueError(f"{self.mcore}: expected an expert parameter on MoE layers with {{expert}} in its names")

    def in_layer(self, config: ModelConfig, layer: int) -> bool:
        if not self.present(config):
            return False
        if self.layers == ALL_LAYERS:
            return True
        return config.layer_is_moe(layer) == (self.layers == MOE_LAYERS)

    def bind(self, config: ModelConfig, local: int | None = None, layer: int | None = None,
             expert: int | None = None, local_expert: int | None = None) -> Param:
        """The concrete parameter: Megatron name with stage-local layer ``local`` (and local expert
        ``local_expert``), HF / rollout names with global layer ``layer`` (and global ``expert``)."""
        shapes = self.shapes(config)
        if len(shapes) != len(self.hf):
            raise ValueError(f"{self.mcore}: expected one shape per HF tensor {self.hf}, found {shapes}")
        return Param(
            role=self.role, mcore=self.mcore.format(layer=local, expert=local_expert),
            hf=tuple(n.format(layer=layer, expert=expert) for n in self.hf),
            shapes=shapes, fusion=self.fusion, train_tp=self.train_tp,
            rollout=None if self.rollout is None else self.rollout.format(layer=layer), rollout_tp=self.rollout_tp,
            expert=expert,
        )

    def bind_stacked(self, config: ModelConfig, layer: int) -> Param:
        """An expert parameter as the rollout holds it: every expert's parts, expert-major, one tensor."""
        per_expert = [self.bind(config, None, layer, e, 0) for e in range(config.num_experts)]
        return Param(
            role=self.role, mcore="", hf=tuple(n for p in per_expert for n in p.hf),
            shapes=tuple(s for p in per_expert for s in p.shapes), fusion=Fusion.STACKED,
            train_tp=self.train_tp, rollout=self.rollout.format(layer=layer), rollout_tp=self.rollout_tp,
        )


def moe_layer_params(block: str, gate: str, up: str, down: str) -> tuple[ParamSpec, ParamSpec, ParamSpec]:
    """An MoE layer's router and experts as megatron's MoELayer holds them (``mlp.router``, local experts'
    ``linear_fc1`` = [gate shard; up shard], ``linear_fc2``), from the HF block ``block`` (``model.layers.{layer}.``
    plus the MLP's module name) with its router ``gate.weight`` and the expert tensors ``experts.{expert}.<gate>``,
    ``<up>``, ``<down>``; the rollout stacks the experts as SGLang's fused MoE (``experts.w13_weight`` /
    ``w2_weight``)."""
    mg, experts = "decoder.layers.{layer}.mlp.", block + "experts.{expert}."
    return (
        ParamSpec("router", mg + "router.weight", (block + "gate.weight",),
                  lambda c: ((c.num_experts, c.hidden_size),), TP.REPLICATED, block + "gate.weight", TP.REPLICATED,
                  layers=MOE_LAYERS),
        ParamSpec("expert_fc1", mg + "experts.local_experts.{expert}.linear_fc1.weight",
                  (experts + f"{gate}.weight", experts + f"{up}.weight"),
                  lambda c: ((c.moe_intermediate_size, c.hidden_size),) * 2, TP.COLUMN,
                  block + "experts.w13_weight", TP.COLUMN, Fusion.GATE_UP, layers=MOE_LAYERS, expert=True),
        ParamSpec("expert_fc2", mg + "experts.local_experts.{expert}.linear_fc2.weight", (experts + f"{down}.weight",),
                  lambda c: ((c.hidden_size, c.moe_intermediate_size),), TP.ROW, block + "experts.w2_weight",
                  TP.ROW, layers=MOE_LAYERS, expert=True),
    )


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of one model: a :class:`ParamSpec` with its layer index and shapes filled in."""

    role: str
    mcore: str
    hf: tuple[str, ...]
    shapes: tuple[Shape, ...]
    fusion: Fusion
    train_tp: TP
    rollout: str | None
    rollout_tp: TP
    expert: int | None = None  # the global expert index of a Megatron expert parameter


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """An architecture family: its HF names and config reading, its parameters by stage membership, in HF
    (= rollout) order."""

    model_types: tuple[str, ...]         # the HF ``model_type`` values it serves
    architecture: str                    # config.json's ``architectures`` entry an export writes
    read_hf_config: HFConfigReader       # HF config.json -> the ModelConfig fields but model_type
    embedding: ParamSpec                 # first stage
    layer: tuple[ParamSpec, ...]         # one decoder layer, HF module order
    mcore_layer_order: tuple[str, ...]   # the layer's roles in Megatron's state-dict (module creation) order
    final: tuple[ParamSpec, ...]         # last stage, after the layers
    lm_head: ParamSpec                   # untied lm head; a tied model's output reads the embedding's tensors
    score_head: ParamSpec                # the value / score heads (one scalar per token); training only
    unsupported_hf: tuple[str, ...] = ()  # HF name suffixes no layout holds: a checkpoint with them is refused
    unsupported_note: str = ""           # what is missing and why: "HF checkpoint: {note}, found {name}"

    def __post_init__(self):
        if not self.architecture:
            raise ValueError(f"{self.model_types}: expected an HF architecture name, found none")
        roles = [p.role for p in self.layer]
        if sorted(roles) != sorted(self.mcore_layer_order) or len(set(roles)) != len(roles):
            raise ValueError(f"{self.model_types}: expected mcore_layer_order to order the layer's roles {roles}, "
                             f"found {self.mcore_layer_order}")

    def _layer(self, config: ModelConfig, local: int, layer: int, order: tuple[str, ...],
               experts: range | None = None) -> list[Param]:
        """One layer's parameters in ``order``. ``experts``: the global experts this rank holds, each
        expert's parameters together (Megatron: ``local_experts.{j}`` in turn); None: stacked (rollout)."""
        by_role = {p.role: p for p in self.layer}
        out: list[Param] = []
        expert_roles = [r for r in order if by_role[r].expert and by_role[r].in_layer(config, layer)]
        for role in order:
            spec = by_role[role]
            if not spec.in_layer(config, layer):
                continue
            if not spec.expert:
                out.append(spec.bind(config, local, layer))
            elif experts is None:
                out.append(spec.bind_stacked(config, layer))
            elif role == expert_roles[0]:
                out += [by_role[r].bind(config, local, layer, e, j)
                        for j, e in enumerate(experts) for r in expert_roles]
        return out

    def mcore_params(self, config: ModelConfig, pp_size: int, pp_rank: int, head: str = "lm",
                     ep_size: int = 1, ep_rank: int = 0) -> list[Param]:
        """Stage ``pp_rank``'s parameters in GPTModel state-dict order (``pp_size`` must divide the layers).
        ``head`` "lm": the vocab output layer (absent when tied on one stage; with pp > 1 the last stage holds
        its own copy of the embedding); any other head: the one-scalar ``score_head``. Expert parallel rank
        ``ep_rank`` of ``ep_size`` holds experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``."""
        per_stage = config.num_hidden_layers // pp_size
        per_rank = config.num_experts // ep_size
        experts = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        out: list[Param] = []
        if pp_rank == 0:
            out.append(self.embedding.bind(config))
        for k in range(per_stage):
            out += self._layer(config, k, pp_rank * per_stage + k, self.mcore_layer_order, experts)
        if pp_rank == pp_size - 1:
            out += [p.bind(config) for p in self.final if p.present(config)]
            if head != "lm":
                out.append(self.score_head.bind(config))
            elif not config.tie_word_embeddings:
                out.append(self.lm_head.bind(config))
            elif pp_size > 1:
                embedding = self.embedding.bind(config)
                out.append(dataclasses.replace(self.lm_head.bind(config), hf=embedding.hf, shapes=embedding.shapes))
        return out

    def rollout_params(self, config: ModelConfig) -> list[Param]:
        """Every parameter of the lm model in HF (= rollout flat-buffer) order; tied: no lm head."""
        order = tuple(p.role for p in self.layer)
        out = [self.embedding.bind(config)]
        for i in range(config.num_hidden_layers):
            out += self._layer(config, i, i, order)
        out += [p.bind(config) for p in self.final if p.present(config)]
        if not config.tie_word_embeddings:
            out.append(self.lm_head.bind(config))
        return out

    def hf_shapes(self, config: ModelConfig) -> dict[str, Shape]:
        """Every tensor of the lm model's HF checkpoint (unfused, unpadded), in rollout order (experts:
        each stacked parameter's tensors, expert-major)."""
        return {name: shape for p in self.rollout_params(config) for name, shape in zip(p.hf, p.shapes, strict=True)}

    def rollout_layer(self, config: ModelConfig, layer: int) -> dict[str, str]:
        """Role -> rollout name of every parameter global layer ``layer`` holds."""
        return {p.role: p.rollout for p in self._layer(config, layer, layer, tuple(s.role for s in self.layer))}

    def rollout_name(self, role: str, layer: int | None = None) -> str:
        """The rollout engine's name of the parameter ``role`` (of global layer ``layer`` for a layer's)."""
        for p in (self.embedding, *self.layer, *self.final, self.lm_head):
            if p.role == role and p.rollout is not None:
                return p.rollout.format(layer=layer)
        raise KeyError(f"rollout parameter: expected a role of {self.model_types}, found {role!r}")
