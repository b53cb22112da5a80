"""HF safetensors <-> per-rank megatron-core GPTModel shards, for any (tp, pp) and, with experts, (ep, etp).

The mapping comes from the architecture's model spec (``verl.models.spec``): each megatron parameter
names the HF tensor(s) it is made of, and its fusion + training TP placement pick a layout rule that
says how one TP rank's shard is cut from them (and how the shards merge back):

  replicated  every rank holds the HF tensor
  vocab       rows padded with zeros to Megatron's padded vocab, split on dim 0
  row         split on dim 1 (input dim of a row-parallel linear)
  qkv         rows regrouped per query group [q heads of the group; k; v], groups split across TP
  gate_up     [gate shard; up shard]

Rules are listed in GPTModel state-dict order (``ModelSpec.mcore_params``). An expert's rule (``expert``
set) holds global expert ``expert``: its rank is the EP rank ``expert // (E/ep)`` and it is cut over the
expert-tensor-parallel ranks (etp) instead of the dense tp ones.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from verl.errors import InputError
from verl.models.config import ModelConfig
from verl.models.mcore.model import check_parallel_layout, padded_vocab_size
from verl.models.spec.base import TP, Fusion
from verl.models.spec.registry import model_spec


class WeightsError(InputError):
    """An HF checkpoint or a set of shards that does not match the model config."""


# ----------------------------------------------------------------------------- layout rules
@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    shard: Callable[[Sequence[torch.Tensor], ModelConfig, int, int], torch.Tensor]
    merge: Callable[[Sequence[torch.Tensor], ModelConfig], list[torch.Tensor]]

    def __repr__(self) -> str:
        return self.name


def _replicated_shard(full, config, tp, rank):
    return full[0]


def _replicated_merge(shards, config):
    return [shards[0]]


def _vocab_shard(full, config, tp, rank):
    weight = full[0]
    padded = weight.new_zeros((padded_vocab_size(config.vocab_size, tp),) + tuple(weight.shape[1:]))
    padded[: weight.size(0)] = weight
    return padded.chunk(tp, dim=0)[rank]


def _vocab_merge(shards, config):
    return [torch.cat(list(shards), dim=0)[: config.vocab_size]]


def _row_shard(full, config, tp, rank):
    return full[0].chunk(tp, dim=1)[rank]


def _row_merge(shards, config):
    return [torch.cat(list(shards), dim=1)]


def _qkv_groups(config: ModelConfig) -> tuple[int, int]:
    """(query groups, rows per group = (heads per group + 2) * head_dim)."""
    groups = config.num_query_groups
    return groups, (config.num_attention_heads // groups + 2) * config.head_dim


def _qkv_shard(full, config, tp, rank):
    q, k, v = full
    groups, _ = _qkv_groups(config)
    tail = tuple(q.shape[1:])
    per_group = torch.cat([q.reshape((groups, -1) + tail), k.reshape((groups, -1) + tail),
                           v.reshape((groups, -1) + tail)], dim=1)
    return per_group.chunk(tp, dim=0)[rank].reshape((-1,) + tail)


def _qkv_merge(shards, config):
    groups, rows = _qkv_groups(config)
    merged = torch.cat(list(shards), dim=0)
    tail = tuple(merged.shape[1:])
    per_group = merged.reshape((groups, rows) + tail)
    q_rows = config.num_attention_heads // groups * config.head_dim
    q, k, v = per_group.split([q_rows, config.head_dim, config.head_dim], dim=1)
    return [t.reshape((-1,) + tail) for t in (q, k, v)]


def _gate_up_shard(full, config, tp, rank):
    gate, up = full
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)


def _gate_up_merge(shards, config):
    halves = [s.chunk(2, dim=0) for s in shards]
    return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]


REPLICATED = Layout("replicated", _replicated_shard, _replicated_merge)
VOCAB = Layout("vocab", _vocab_shard, _vocab_merge)
ROW = Layout("row", _row_shard, _row_merge)
QKV = Layout("qkv", _qkv_shard, _qkv_merge)
GATE_UP = Layout("gate_up", _gate_up_shard, _gate_up_merge)


@dataclasses.dataclass(frozen=True)
class WeightRule:
    mcore: str
    hf: tuple[str, ...]
    layout: Layout
    expert: int | None = None  # the global expert of an expert parameter


# The rule of each (fusion, training TP placement) a spec uses.
_RULES = {
    (Fusion.NONE, TP.REPLICATED): REPLICATED,
    (Fusion.NONE, TP.VOCAB): VOCAB,
    (Fusion.NONE, TP.ROW): ROW,
    (Fusion.QKV, TP.COLUMN): QKV,
    (Fusion.GATE_UP, TP.COLUMN): GATE_UP,
}


def weight_rules(config: ModelConfig, pp_size: int, pp_rank: int, head: str = "lm", ep_size: int = 1,
                 ep_rank: int = 0) -> list[WeightRule]:
    """The rules for every parameter of pipeline stage ``pp_rank`` (and EP rank ``ep_rank``), in GPTModel
    state-dict order."""
    check_parallel_layout(config, 1, pp_size, ep_size, 1)
    return [WeightRule(p.mcore, p.hf, _RULES[p.fusion, p.train_tp], p.expert)
            for p in model_spec(config.model_type).mcore_params(config, pp_size, pp_rank, head, ep_size, ep_rank)]


def hf_names(config: ModelConfig, head: str = "lm") -> list[str]:
    """Every tensor of the HF checkpoint for ``config`` (no duplicates, HF's usual order)."""
    names: list[str] = []
    for rule in weight_rules(config, 1, 0, head):
        names += [n for n in rule.hf if n not in names]
    return names


# ----------------------------------------------------------------------------- shard
def to_mcore_shard(config: ModelConfig, get_hf: Callable[[str], torch.Tensor], tp_size: int, pp_size: int,
                   tp_rank: int, pp_rank: int, head: str = "lm", ep_size: int = 1, ep_rank: int = 0,
                   etp_size: int | None = None, etp_rank: int | None = None) -> OrderedDict[str, torch.Tensor]:
    """This rank's megatron state dict (parameters only) from HF tensors fetched by name. ``etp`` None:
    experts are split over the dense tp ranks (megatron's default)."""
    etp_size, etp_rank = (tp_size, tp_rank) if etp_size is None else (etp_size, etp_rank)
    check_parallel_layout(config, tp_size, pp_size, ep_size, etp_size)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for rule in weight_rules(config, pp_size, pp_rank, head, ep_size, ep_rank):
        full = [get_hf(name) for name in rule.hf]
        size, rank = (tp_size, tp_rank) if rule.expert is None else (etp_size, etp_rank)
        out[rule.mcore] = rule.layout.shard(full, config, size, rank).clone()
    return out


# An expert's HF tensor: model.layers.{i}.<mlp | block_sparse_moe>.experts.{e}.<...>
_EXPERT_NAME = re.compile(r"^model\.layers\.\d+\.\w+\.experts\.\d+\.")


def check_expert_tensors(config: ModelConfig, names: Iterable[str]) -> None:
    """The checkpoint's expert tensors, by name and count, against the config: a missing one, or one of an
    expert or layer the config does not have (``experts.{E}``, a dense layer's experts), is one error naming it."""
    expected = {n for n in hf_names(config) if _EXPERT_NAME.match(n)}
    found = {n for n in names if _EXPERT_NAME.match(n)}
    extra, missing = sorted(found - expected), sorted(expected - found)
    if extra:
        raise WeightsError(f"HF checkpoint: expected the {len(expected)} expert tensors of num_experts="
                           f"{config.num_experts} on MoE layers {list(config.moe_layers)}, found {extra[0]}"
                           + (f" and {len(extra) - 1} more" if len(extra) > 1 else ""))
    if missing:
        raise WeightsError(f"HF checkpoint: expected {missing[0]}" + (f" and {len(missing) - 1} more expert tensors"
                           if len(missing) > 1 else "") + f" (num_experts={config.num_experts}), found it missing")


# ----------------------------------------------------------------------------- live model
def load_hf_into_model(model: torch.nn.Module, config: ModelConfig, get_hf: Callable[[str], torch.Tensor],
                       head: str = "lm", names: Iterable[str] | None = None) -> None:
    """Copy HF tensors into this rank's model in place (keeps DDP / optimizer views valid). ``names``: every
    tensor name of the checkpoint, to check its experts (:func:`check_expert_tensors`) first."""
    from megatron.core import parallel_state as mpu

    if names is not None:
        check_expert_tensors(config, names)

    shard = to_mcore_shard(config, get_hf, mpu.get_tensor_model_parallel_world_size(),
                           mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank(),
                           mpu.get_pipeline_model_parallel_rank(), head,
                           mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_rank(),
                           mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank())
    params = dict(model.named_parameters())
    if set(params) != set(shard):
        raise WeightsError(f"model parameters: expected {sorted(shard)}, found {sorted(params)}")
    with torch.no_grad():
        for name, tensor in shard.items():
            if params[name].shape != tensor.shape:
                raise WeightsError(f"{name}: expected shape {tuple(tensor.shape)}, found {tuple(params[name].shape)}")
            params[name].copy_(tensor)


def export_spans_data_parallel() -> bool:
    """Whether one model copy's experts live beyond the first DP replica's TP/PP group (ep * etp > tp):
    then every rank takes part in :func:`iter_hf_from_model`."""
    from megatron.core import parallel_state as mpu

    return (mpu.get_expert_model_parallel_world_size() * mpu.get_expert_tensor_parallel_world_size()
            > mpu.get_tensor_model_parallel_world_size())


def _stage_rules(config: ModelConfig, pp: int, stage: int, head: str, ep: int) -> list[WeightRule]:
    """Stage ``stage``'s rules over every EP rank: each run of expert rules lists EP rank 0's experts, then
    rank 1's, ... (every expert once, in order); the other rules once."""
    per_ep = [weight_rules(config, pp, stage, head, ep, e) for e in range(ep)]
    out: list[WeightRule] = []
    i = 0
    while i < len(per_ep[0]):
        if per_ep[0][i].expert is None:
            out.append(per_ep[0][i])
            i += 1
            continue
        j = i
        while j < len(per_ep[0]) and per_ep[0][j].expert is not None:
            j += 1
        for rules in per_ep:
            out += rules[i:j]
        i = j
    return out


def iter_hf_from_model(model: torch.nn.Module, config: ModelConfig,
                       head: str = "lm") -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors, one at a time, gathered from every TP/PP (and EP/ETP) rank's shard. Collective over
    the model-parallel group, or over every rank when the experts live beyond it
    (:func:`export_spans_data_parallel`): every rank of it iterates to the end. The tensors are yielded on
    the lowest global rank with (tp 0, pp 0) only; elsewhere the iterator yields nothing. Each shard comes
    from the lowest rank holding it (the first DP / expert-DP replica). Peak extra memory
    is one HF tensor and its shards, whatever the model size."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    tp, pp = mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
    ep, etp = mpu.get_expert_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size()
    group = None if export_spans_data_parallel() else mpu.get_model_parallel_group()
    params = dict(model.named_parameters())
    # Who holds what: one small record per rank, once.
    mine = dict(rank=dist.get_rank(), tp=mpu.get_tensor_model_parallel_rank(),
                pp=mpu.get_pipeline_model_parallel_rank(), dp=mpu.get_data_parallel_rank(),
                ep=mpu.get_expert_model_parallel_rank(), etp=mpu.get_expert_tensor_parallel_rank(),
                edp=mpu.get_expert_data_parallel_rank() if config.is_moe else 0,
                meta={n: (tuple(p.shape), str(p.dtype)) for n, p in params.items()})
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    dense: dict[tuple[int, int], dict] = {}
    experts: dict[tuple[int, int, int], dict] = {}
    for r in sorted(everyone, key=lambda r: r["rank"]):  # the lowest rank holding each shard sends it
        dense.setdefault((r["tp"], r["pp"]), r)
        experts.setdefault((r["etp"], r["ep"], r["pp"]), r)
    dst = dense[(0, 0)]["rank"]
    me = dist.get_rank()
    device = next(iter(params.values())).device
    per_ep = config.num_experts // ep if config.is_moe else 1
    emitted: set[str] = set()
    for stage in range(pp):
        for rule in _stage_rules(config, pp, stage, head, ep):
            if all(name in emitted for name in rule.hf):
                continue  # the tied output-layer copy on the last stage
            emitted.update(rule.hf)
            if rule.expert is None:
                holders = [dense[(t, stage)] for t in range(tp)]
            else:
                holders = [experts[(k, rule.expert // per_ep, stage)] for k in range(etp)]
            missing = [h["rank"] for h in holders if rule.mcore not in h["meta"]]
            if missing:
                raise WeightsError(f"megatron shard (pp_rank={stage}, rank {missing[0]}): expected "
                                   f"{rule.mcore}, found it missing")
            if me != dst:
                if any(h["rank"] == me for h in holders):
                    dist.send(params[rule.mcore].detach().contiguous(), dst=dst)
                continue
            parts = []
            for h in holders:
                if h["rank"] == me:
                    parts.append(params[rule.mcore].detach())
                    continue
                shape, dtype = h["meta"][rule.mcore]
                buffer = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
                dist.recv(buffer, src=h["rank"])
                parts.append(buffer)
            merged = rule.layout.merge(parts, config)
            del parts
            for name, tensor in zip(rule.hf, merged, strict=True):
                yield name, tensor.contiguous()
            del merged
