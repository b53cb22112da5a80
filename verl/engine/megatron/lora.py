"""LoRA adapters on megatron-core's column/row-parallel linears (names and shards: :mod:`verl.engine.lora`).

Each targeted linear gets two submodules, ``lora_A`` ([r, in_local] for a row-parallel linear, [r, in] else) and
``lora_B`` ([out_local, r] for a column-parallel linear, [out, r] else), and a forward hook that adds
``(alpha / r) * B (A x)`` to the linear's output with the TP collectives the split asks for (see the package
docstring). The model spec's layout rules (:mod:`verl.models.mcore.weights`) cut and merge the factors: ``B`` of a
column-parallel linear with the linear's own rule (QKV per-group regrouping, gate-up halves), ``A`` of a
row-parallel linear with the row rule, the other factor replicated; so a full HF-named adapter (PEFT's) maps to
any (tp, pp) and back.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from verl.engine.lora import (
    MEGATRON_TARGETS,
    LoRAError,
    LoRASettings,
    in_modules,
    is_adapter_name,
    matches,
    trained_names,
)
from verl.models.config import ModelConfig

COLUMN, ROW = "column", "row"


def _kind(linear: torch.nn.Module) -> str:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(linear, ColumnParallelLinear):
        return COLUMN
    if isinstance(linear, RowParallelLinear):
        return ROW
    raise LoRAError(f"LoRA target {type(linear).__name__}: expected megatron's ColumnParallelLinear or "
                    "RowParallelLinear")


def _lora_hook(linear: torch.nn.Module, args: tuple, output):
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
        reduce_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    if linear.disable_adapters:
        return output
    out, bias = output
    x = linear.lora_dropout(args[0])
    a, b = linear.lora_A.weight, linear.lora_B.weight
    t = torch.nn.functional.linear(x.to(a.dtype), a)
    if linear.lora_kind == COLUMN:
        # Each rank's B rows need the whole sequence's A x; backward sums the ranks' partial dA x terms.
        t = gather_from_sequence_parallel_region(t) if linear.sequence_parallel else \
            copy_to_tensor_model_parallel_region(t)
        y = torch.nn.functional.linear(t, b) * linear.lora_scale
    else:
        # A_local x_local summed over TP is A x: [s, b, r], the cheap place to reduce.
        t = reduce_from_tensor_model_parallel_region(t)
        y = torch.nn.functional.linear(t, b) * linear.lora_scale
        if linear.sequence_parallel:  # the row linear's output is this rank's sequence shard
            y = scatter_to_sequence_parallel_region(y)
    return (out + y.to(out.dtype), bias)


def target_linears(module: torch.nn.Module, settings: LoRASettings, config: ModelConfig
                   ) -> dict[str, torch.nn.Module]:
    """This stage's linears ``settings`` names: target_modules minus exclude_modules; none matching on any rank
    is an error (collective when torch.distributed is up)."""
    # Patterns see global layer numbers (decoder.layers.{i} as at pp 1), whatever stage holds the layer.
    found = {name: m for name, m in module.named_modules()
             if name and matches(_global_name(name, config), settings.target_modules)
             and not matches(_global_name(name, config), settings.exclude_modules)}
    experts = [n for n in found if ".experts." in n]
    if experts:
        raise LoRAError(f"{settings.where}.target_modules: {experts[0]} is an MoE expert's linear; adapters on "
                        "experts (grouped GEMMs split over EP) are not implemented: exclude them")
    total = torch.tensor([len(found)], dtype=torch.long, device=next(module.parameters()).device)
    if dist.is_initialized() and dist.get_world_size() > 1:  # a stage may hold none of a pattern's layers
        dist.all_reduce(total)
    if not int(total):
        raise LoRAError(f"{settings.where}.target_modules: expected Megatron linears ({', '.join(MEGATRON_TARGETS)} "
                        f"or patterns of their full names), found none matching {list(settings.target_modules)}"
                        + (f" minus {list(settings.exclude_modules)}" if settings.exclude_modules else ""))
    return found


def _global_name(name: str, config: ModelConfig) -> str:
    """A stage-local ``decoder.layers.{i}.`` name with the global layer index (seeds the same on any pp)."""
    from megatron.core import parallel_state as mpu

    if not name.startswith("decoder.layers."):
        return name
    per_stage = config.num_hidden_layers // mpu.get_pipeline_model_parallel_world_size()
    local, _, rest = name[len("decoder.layers."):].partition(".")
    layer = mpu.get_pipeline_model_parallel_rank() * per_stage + int(local)
    return f"decoder.layers.{layer}" + (f".{rest}" if rest else "")


def apply_lora(module: torch.nn.Module, config: ModelConfig, settings: LoRASettings, seed: int = 0,
               keep: Sequence[str] = ()) -> list[str]:
    """Freeze ``module`` but the modules ``keep`` names (a critic's value head: :func:`verl.engine.lora.value_head`)
    and put adapters on its targeted linears (before DDP wraps it, so its buffers and the optimizer hold the
    adapters, and ``keep``, only). ``A`` starts as PEFT's kaiming-uniform draw of the full [r, in] matrix from
    a generator seeded by ``seed`` and the linear's global name (the same adapter at any tp/pp), ``B`` at zero.
    Returns the adapted linears' names."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if config.is_moe:
        raise LoRAError(f"{settings.where}: LoRA on MoE models is not implemented (adapters on the experts' grouped "
                        "linears under expert parallelism): use a dense model or LoRA off")
    targets = target_linears(module, settings, config)
    for name, p in module.named_parameters():
        p.requires_grad_(in_modules(name, keep))
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    r = settings.rank
    for name, linear in targets.items():
        kind = _kind(linear)
        weight = linear.weight
        out_local, in_local = weight.shape
        in_full = in_local * (tp if kind == ROW else 1)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(_global_name(name, config).encode()))
        a_full = torch.empty(r, in_full)
        torch.nn.init.kaiming_uniform_(a_full, a=5 ** 0.5, generator=generator)
        a_local = a_full.chunk(tp, dim=1)[tp_rank] if kind == ROW else a_full
        lora_a = torch.nn.Linear(a_local.size(1), r, bias=False, device=weight.device, dtype=weight.dtype)
        lora_b = torch.nn.Linear(r, out_local, bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            lora_a.weight.copy_(a_local)
            lora_b.weight.zero_()
        split, replicated = (lora_b.weight, lora_a.weight) if kind == COLUMN else (lora_a.weight, lora_b.weight)
        set_tensor_model_parallel_attributes(split, True, 0 if kind == COLUMN else 1, 1)
        # The replicated factor that sees a sequence shard: megatron sums its gradient over TP.
        replicated.sequence_parallel = bool(linear.sequence_parallel)
        linear.lora_A, linear.lora_B = lora_a, lora_b
        linear.lora_dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()
        linear.lora_kind, linear.lora_scale, linear.disable_adapters = kind, settings.scale, False
        linear.register_forward_hook(_lora_hook)
    return sorted(targets)


def adapted_linears(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in module.named_modules() if hasattr(m, "lora_kind")}


# ----------------------------------------------------------------------------- merged weights (reshard)
def merged_parameters(module: torch.nn.Module, *args, **kwargs):
    """(name, base parameter, its value in the merged model) of every base parameter: an adapted linear's shard of
    ``W + (alpha/r) B A`` in fp32 (``B_local A`` for a column linear, ``B A_local`` for a row one, which are exactly
    the rows / columns of the merged weight this shard holds), any other parameter itself. Call under no_grad."""
    merged = {f"{name}.weight": m for name, m in adapted_linears(module).items()}
    for name, p in module.named_parameters(*args, **kwargs):
        if is_adapter_name(name):
            continue
        linear = merged.get(name)
        if linear is None:
            yield name, p, p
        else:
            yield name, p, p.float() + linear.lora_scale * (linear.lora_B.weight.float() @ linear.lora_A.weight.float())


def merged_reshard_sources(module: torch.nn.Module, dtype: torch.dtype, device: torch.device | str
                           ) -> dict[str, torch.Tensor]:
    """``{base parameter name: this rank's shard of the merged weight, 1-D}``: the dense model the rollout serves
    (``merge=true``). Adapters themselves are not sources."""
    with torch.no_grad():
        return {name: value.detach().to(device=device, dtype=dtype).contiguous().reshape(-1)
                for name, _, value in merged_parameters(module)}


class MergedView(torch.nn.Module):
    """The model as a dense one for export: base parameters by name, each adapted linear's as this rank's shard
    of ``W + (alpha/r) B A`` (computed in fp32, cast back to ``W``'s dtype)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self._wrapped = [module]

    def named_parameters(self, *args, **kwargs):
        with torch.no_grad():
            for name, p, value in merged_parameters(self._wrapped[0], *args, **kwargs):
                yield name, value.to(p.dtype)


# ----------------------------------------------------------------------------- full HF-named adapters
def _adapter_rules(config: ModelConfig, module: torch.nn.Module):
    """(linear name, kind, A's HF names, B's HF names, the linear's weight layout) of this stage's adapters."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore.weights import weight_rules

    linears = adapted_linears(module)
    rules = {rule.mcore: rule for rule in weight_rules(config, mpu.get_pipeline_model_parallel_world_size(),
                                                       mpu.get_pipeline_model_parallel_rank())}
    out = []
    for name, linear in linears.items():
        rule = rules.get(f"{name}.weight")
        if rule is None:
            raise LoRAError(f"LoRA: {name} is not a linear of the model spec's HF mapping")
        a_names = tuple(h.removesuffix(".weight") + ".lora_A.weight" for h in rule.hf)
        b_names = tuple(h.removesuffix(".weight") + ".lora_B.weight" for h in rule.hf)
        out.append((name, linear, a_names, b_names, rule.layout))
    return out


def load_full_adapters(module: torch.nn.Module, config: ModelConfig, get: Callable[[str], torch.Tensor]) -> None:
    """Set this rank's adapter shards from full HF-named adapters (``get(name)``, PEFT's names without the
    ``base_model.model.`` prefix). A fused Megatron linear shares one A: q/k/v (gate/up) must carry the same A."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore.weights import REPLICATED, ROW

    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, linear, a_names, b_names, layout in _adapter_rules(config, module):
            a_full = [get(n) for n in a_names]
            if any(not torch.equal(a_full[0], a) for a in a_full[1:]):
                raise LoRAError(f"LoRA adapter: {', '.join(a_names)} differ, but Megatron's fused {name} shares "
                                "one A across them: expected equal lora_A tensors")
            b_full = [get(n) for n in b_names]
            if linear.lora_kind == COLUMN:
                a_local, b_local = a_full[0], layout.shard(b_full, config, tp, tp_rank)
            else:
                a_local, b_local = ROW.shard(a_full[:1], config, tp, tp_rank), REPLICATED.shard(b_full, config, tp,
                                                                                               tp_rank)
            for param, value, what in ((linear.lora_A.weight, a_local, a_names[0]),
                                       (linear.lora_B.weight, b_local, b_names[0])):
                if tuple(param.shape) != tuple(value.shape):
                    raise LoRAError(f"LoRA adapter: {what}: expected shape {tuple(param.shape)} for this model "
                                    f"(rank {param.shape[0] if what.endswith('lora_A.weight') else param.shape[1]}), "
                                    f"found {tuple(value.shape)} after sharding")
                param.copy_(value)


def gather_full_adapters(module: torch.nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every adapter as full HF-named tensors (q/k/v of a fused A each get that A; B split by the linear's rows),
    on every rank. Collective over the world (adapters are small)."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore.weights import ROW

    tp, group = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_group()

    def gathered(t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
        return [p.cpu() for p in parts]

    stage: dict[str, torch.Tensor] = {}
    for name, linear, a_names, b_names, layout in _adapter_rules(config, module):
        a, b = linear.lora_A.weight.detach(), linear.lora_B.weight.detach()
        if linear.lora_kind == COLUMN:
            a_full, b_full = [a.cpu().clone()] * len(a_names), layout.merge(gathered(b), config)
        else:
            a_full, b_full = ROW.merge(gathered(a), config), [b.cpu().clone()]
        stage.update(zip(a_names, a_full, strict=True))
        stage.update(zip(b_names, b_full, strict=True))
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return stage
    stages: list[Mapping[str, torch.Tensor] | None] = [None] * mpu.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, stage, group=mpu.get_pipeline_model_parallel_group())
    return {k: v for s in stages for k, v in s.items()}


# ----------------------------------------------------------------------------- dist_checkpointing
def adapter_sharded_state(module: torch.nn.Module, model_state: dict, adapters_only: bool) -> dict:
    """``module.sharded_state_dict()`` with the adapters' entries sharded as their parameters are.

    megatron builds a parallel linear's entries from its whole ``state_dict``, so the adapter submodules come out
    as plain tensors replicated over TP: only tp rank 0's copy would be written, and every rank would load it
    back, losing the other ranks' rows of a column linear's ``B`` (and columns of a row linear's ``A``). Here the
    split factor becomes a TP-sharded tensor on the linear's own axis (``B`` of ``linear_fc1`` under a gated
    unit through megatron's gate/up factory, as ``W``), which also makes it loadable at another TP.
    ``adapters_only``: the entries of what trains alone (``save_lora_only``; the base is the HF checkpoint): the
    adapters, and a critic's value head."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    linears = adapted_linears(module)
    trained = trained_names(module)
    out = {k: v for k, v in model_state.items() if k in trained} if adapters_only else dict(model_state)
    found = 0
    for key, entry in model_state.items():
        if not is_adapter_name(key):
            continue
        name, factor = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        linear = linears.get(name)
        if linear is None:
            raise RuntimeError(f"LoRA checkpoint: {key} names no adapted linear of this model")
        found += 1
        split = (linear.lora_kind == COLUMN and factor == "lora_B") or (linear.lora_kind == ROW and factor == "lora_A")
        if not split:
            out[key] = entry  # replicated over TP: megatron's default entry is right
            continue
        prepend = tuple((axis, entry.global_offset[axis], entry.axis_fragmentations[axis])
                        for axis in range(entry.prepend_axis_num))
        axis = 0 if linear.lora_kind == COLUMN else 1
        sharded = make_tp_sharded_tensor_for_checkpoint(entry.data, entry.key, axis, prepend_offsets=prepend)
        if linear.lora_kind == COLUMN and name.endswith("linear_fc1") and linear.config.gated_linear_unit:
            sharded = apply_swiglu_sharded_factory(sharded, prepend)  # [gate_local; up_local], as W's rows
        out[key] = sharded
    if found != 2 * len(linears):
        raise RuntimeError(f"LoRA checkpoint: expected {2 * len(linears)} adapter entries in the sharded state, "
                           f"found {found}")
    return out
