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
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verl.models.config import ModelConfig

Shape = tuple[int, ...]


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
    """An architecture family: its parameters by stage membership, in HF (= rollout) order."""

    model_types: tuple[str, ...]         # the HF ``model_type`` values it serves
    embedding: ParamSpec                 # first stage
    layer: tuple[ParamSpec, ...]         # one decoder layer, HF module order
    mcore_layer_order: tuple[str, ...]   # the layer's roles in Megatron's state-dict (module creation) order
    final: tuple[ParamSpec, ...]         # last stage, after the layers
    lm_head: ParamSpec                   # untied lm head; a tied model's output reads the embedding's tensors
    score_head: ParamSpec                # the value / score heads (one scalar per token); training only
    unsupported_hf: tuple[str, ...] = ()  # HF name suffixes no layout holds: a checkpoint with them is refused
    unsupported_note: str = ""           # what is missing and why: "HF checkpoint: {note}, found {name}"

    def __post_init__(self):
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
