"""HF safetensors <-> per-rank megatron-core GPTModel shards, for any (tp, pp).

The mapping comes from the architecture's model spec (``verl.models.spec``): each megatron parameter
names the HF tensor(s) it is made of, and its fusion + training TP placement pick a layout rule that
says how one TP rank's shard is cut from them (and how the shards merge back):

  replicated  every rank holds the HF tensor
  vocab       rows padded with zeros to Megatron's padded vocab, split on dim 0
  row         split on dim 1 (input dim of a row-parallel linear)
  qkv         rows regrouped per query group [q heads of the group; k; v], groups split across TP
  gate_up     [gate shard; up shard]

Rules are listed in GPTModel state-dict order (``ModelSpec.mcore_params``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

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


# The rule of each (fusion, training TP placement) a spec uses.
_RULES = {
    (Fusion.NONE, TP.REPLICATED): REPLICATED,
    (Fusion.NONE, TP.VOCAB): VOCAB,
    (Fusion.NONE, TP.ROW): ROW,
    (Fusion.QKV, TP.COLUMN): QKV,
    (Fusion.GATE_UP, TP.COLUMN): GATE_UP,
}


def weight_rules(config: ModelConfig, pp_size: int, pp_rank: int, head: str = "lm") -> list[WeightRule]:
    """The rules for every parameter of pipeline stage ``pp_rank``, in GPTModel state-dict order."""
    check_parallel_layout(config, 1, pp_size)
    return [WeightRule(p.mcore, p.hf, _RULES[p.fusion, p.train_tp])
            for p in model_spec(config.model_type).mcore_params(config, pp_size, pp_rank, head)]


def hf_names(config: ModelConfig, head: str = "lm") -> list[str]:
    """Every tensor of the HF checkpoint for ``config`` (no duplicates, HF's usual order)."""
    names: list[str] = []
    for rule in weight_rules(config, 1, 0, head):
        names += [n for n in rule.hf if n not in names]
    return names


# ----------------------------------------------------------------------------- shard <-> merge
def to_mcore_shard(config: ModelConfig, get_hf: Callable[[str], torch.Tensor], tp_size: int, pp_size: int,
                   tp_rank: int, pp_rank: int, head: str = "lm") -> OrderedDict[str, torch.Tensor]:
    """This rank's megatron state dict (parameters only) from HF tensors fetched by name."""
    check_parallel_layout(config, tp_size, pp_size)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for rule in weight_rules(config, pp_size, pp_rank, head):
        full = [get_hf(name) for name in rule.hf]
        out[rule.mcore] = rule.layout.shard(full, config, tp_size, tp_rank).clone()
    return out


def to_hf(config: ModelConfig, shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], tp_size: int,
          pp_size: int, head: str = "lm") -> dict[str, torch.Tensor]:
    """HF tensors from every rank's megatron state dict, keyed by (tp_rank, pp_rank)."""
    check_parallel_layout(config, tp_size, pp_size)
    missing = [(t, p) for p in range(pp_size) for t in range(tp_size) if (t, p) not in shards]
    if missing:
        raise WeightsError(f"megatron shards: expected all (tp_rank, pp_rank) of tp={tp_size} pp={pp_size}, "
                           f"found none for {missing}")
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp_size):
        for rule in weight_rules(config, pp_size, pp_rank, head):
            if all(name in out for name in rule.hf):
                continue  # the tied output-layer copy on the last stage
            try:
                parts = [shards[(t, pp_rank)][rule.mcore] for t in range(tp_size)]
            except KeyError:
                raise WeightsError(f"megatron shard (pp_rank={pp_rank}): expected {rule.mcore}, "
                                   "found it missing") from None
            for name, tensor in zip(rule.hf, rule.layout.merge(parts, config), strict=False):
                out[name] = tensor.contiguous()
    return {name: out[name] for name in hf_names(config, head)}


# ----------------------------------------------------------------------------- live model
def load_hf_into_model(model: torch.nn.Module, config: ModelConfig, get_hf: Callable[[str], torch.Tensor],
                       head: str = "lm") -> None:
    """Copy HF tensors into this rank's model in place (keeps DDP / optimizer views valid)."""
    from megatron.core import parallel_state as mpu

    shard = to_mcore_shard(config, get_hf, mpu.get_tensor_model_parallel_world_size(),
                           mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank(),
                           mpu.get_pipeline_model_parallel_rank(), head)
    params = dict(model.named_parameters())
    if set(params) != set(shard):
        raise WeightsError(f"model parameters: expected {sorted(shard)}, found {sorted(params)}")
    with torch.no_grad():
        for name, tensor in shard.items():
            if params[name].shape != tensor.shape:
                raise WeightsError(f"{name}: expected shape {tuple(tensor.shape)}, found {tuple(params[name].shape)}")
            params[name].copy_(tensor)


def iter_hf_from_model(model: torch.nn.Module, config: ModelConfig,
                       head: str = "lm") -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors, one at a time, gathered from every TP/PP rank's shard (collective over the
    model-parallel group: every rank of it iterates to the end). They are yielded on the group's
    (tp 0, pp 0) rank only, in HF order; elsewhere the iterator yields nothing. Peak extra memory is
    one HF tensor and its shards, whatever the model size."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    tp, pp = mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
    tp_rank, pp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    group = mpu.get_model_parallel_group()
    params = dict(model.named_parameters())
    # Who holds what: (tp, pp) -> (global rank, {mcore name: (shape, dtype)}); small, once.
    mine = (tp_rank, pp_rank, dist.get_rank(), {n: (tuple(p.shape), str(p.dtype)) for n, p in params.items()})
    everyone = [None] * (tp * pp)
    dist.all_gather_object(everyone, mine, group=group)
    where = {(t, p): (rank, meta) for t, p, rank, meta in everyone}
    dst = where[(0, 0)][0]
    is_dst = dist.get_rank() == dst
    device = next(iter(params.values())).device
    emitted: set[str] = set()
    for stage in range(pp):
        for rule in weight_rules(config, pp, stage, head):
            if all(name in emitted for name in rule.hf):
                continue  # the tied output-layer copy on the last stage
            emitted.update(rule.hf)
            missing = [t for t in range(tp) if rule.mcore not in where[(t, stage)][1]]
            if missing:
                raise WeightsError(f"megatron shard (pp_rank={stage}, tp_rank={missing[0]}): expected "
                                   f"{rule.mcore}, found it missing")
            if stage == pp_rank and not is_dst:
                dist.send(params[rule.mcore].detach().contiguous(), dst=dst, group=group)
            if not is_dst:
                continue
            parts = []
            for t in range(tp):
                if (t, stage) == (tp_rank, pp_rank):
                    parts.append(params[rule.mcore].detach())
                    continue
                src, meta = where[(t, stage)]
                shape, dtype = meta[rule.mcore]
                buffer = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
                dist.recv(buffer, src=src, group=group)
                parts.append(buffer)
            merged = rule.layout.merge(parts, config)
            del parts
            for name, tensor in zip(rule.hf, merged, strict=True):
                yield name, tensor.contiguous()
            del merged
