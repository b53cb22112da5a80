"""LoRA on either training engine: verl's keys, the adapter parameters' names and shards, and the reference as
the base model with its adapters disabled.

Keys (verl's; the critic reads the same under ``critic.model``): the FSDP engines read the flat
``actor_rollout_ref.model.{lora_rank (0 = off), lora_alpha, target_modules ("all-linear" or HF module names),
exclude_modules, lora_adapter_path}`` and put PEFT's LoRA layers on transformers' linears
(:mod:`verl.engine.fsdp.lora`); Megatron reads the block
``actor_rollout_ref.model.lora.{rank, alpha, dropout, target_modules ([linear_qkv, linear_proj, linear_fc1,
linear_fc2] or fnmatch patterns of full module names), exclude_modules, merge, adapter_path}`` and puts adapters on
megatron's own column/row-parallel linears (:mod:`verl.engine.megatron.lora`). Either way the update is
``y = W x + (alpha / r) * B (A x)``, ``A`` [r, in] random (PEFT's kaiming-uniform), ``B`` [out, r] zero, so a
fresh adapter leaves the model unchanged. Only ``A`` and ``B`` require gradients (and a critic's value head:
:func:`value_head`): Megatron's DDP and its (distributed) optimizer build their buffers from ``requires_grad``
parameters only, and the FSDP engine's AdamW is handed those alone, so gradients and optimizer state exist for
the adapters (and value head) only. The frozen base may be bf16 (``megatron.dtype=bfloat16``): megatron's
mixed-precision optimizer keeps fp32 main copies of the trainable parameters only.

Names (what the adapter-only weight sync addresses; every one ends ``lora_A.weight`` / ``lora_B.weight``):

* Megatron: ``<linear>.lora_A.weight`` and ``<linear>.lora_B.weight`` beside the linear's own ``weight``, e.g.
  ``decoder.layers.0.self_attention.linear_qkv.lora_A.weight`` (stage-local layer numbers, as every Megatron
  name). The base parameters keep their names, so the HF <-> Megatron mapping of the model spec is unchanged.
* FSDP (PEFT): the HF module's ``base_layer.weight`` is the frozen base and ``lora_A.default.weight`` /
  ``lora_B.default.weight`` the adapter, e.g. ``model.layers.0.self_attn.q_proj.lora_A.default.weight``;
  :func:`hf_base_name` maps a PEFT name back to the HF tensor name.
* On disk (PEFT's adapter format): ``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight``.

Shards. Megatron: a column-parallel linear (``linear_qkv``, ``linear_fc1``) splits ``W`` on its output rows, so
``B`` is split with exactly ``W``'s rows (the same QKV per-group / gate-up regrouping: a row of ``B`` belongs to
the row of ``W`` it adds to) and ``A`` is replicated: every rank needs ``A x`` for all r ranks of the update,
and ``W_local + s B_local A`` is this rank's rows of the merged weight. A row-parallel linear (``linear_proj``,
``linear_fc2``) splits ``W`` on its input columns, so ``A`` is split on the input dim (the columns of ``A`` meet
the same input slice as ``W_local``) and ``B`` is replicated: ``W_local + s B A_local`` is this rank's columns
of the merged weight, and the update's partial ``A_local x_local`` are summed over TP (one [s, b, r] all-reduce)
before ``B``. Under sequence parallelism the replicated factor that sees a sequence shard (``A`` of a column
linear, ``B`` of a row linear) is marked ``sequence_parallel`` so megatron all-reduces its gradient over TP.
Pipeline stages hold their own layers' adapters. FSDP2: ``A`` and ``B`` are ``Shard(0)`` DTensors like every
parameter (``B``'s rows are ``W``'s rows on every rank; ``A`` is split over r and gathered for a merge).

Rollout (verl's ``actor_rollout_ref.model.lora.merge``, read by both backends). ``merge=true``: each transition
hands the rollout the merged weights ``W + (alpha/r) B A`` by the HF names of the dense model, computed per
training shard (exactly the rows/columns that shard holds), through today's reshard. ``merge=false``: the first
sync sends the frozen base, every later one the adapter shards alone, which each rollout rank merges into its own
rollout shard from a kept copy of the base (:mod:`verl.hybrid_engine.lora_sync`, checksummed end to end).

Checkpoints (``actor_rollout_ref.actor.checkpoint.save_lora_only``, verl's key): off, a LoRA actor's checkpoint
is the engine's usual one (Megatron dist_checkpointing, FSDP DCP) with the adapters in it; on, it holds the
adapters and their optimizer state only, and the base comes from ``model.path`` on resume (it is frozen). Either
resumes bit-exactly. Megatron's sharded state gets the adapters' own TP sharding
(:func:`verl.engine.megatron.lora.adapter_sharded_state`): ``B`` of a column linear split on rows (gate/up halves
through megatron's factory), ``A`` of a row linear on columns, the other factor replicated. HF export
(``trainer.export_hf_*``) writes a PEFT adapter directory at ``<output_dir>/actor_hf`` (``adapter_config.json``
naming the base, ``adapter_model.safetensors``, the tokenizer), and with ``checkpoint.export_merged`` the merged
model at ``<output_dir>/actor_hf_merged``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from verl.utils.config_checks import ConfigError

if TYPE_CHECKING:
    from verl.engine.config_rules import BackendConfigRules

MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# HF modules of each Megatron linear (the dense families' names): what "all-linear" means on FSDP too.
HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_SUFFIXES = ("lora_A.weight", "lora_B.weight", "lora_A.default.weight", "lora_B.default.weight")


FINGERPRINT_SPAN = 1 << 20  # bytes read from each end of each weight file for the base's fingerprint


def base_fingerprint(model_path: str | None) -> str | None:
    """A fingerprint of the HF checkpoint a LoRA model is built on (None for a config-only, seeded model): CRC32
    over each weight file's name, size, safetensors header and its first and last MiB. Two checkpoints of one
    architecture (same names, shapes, header) differ in it unless their weights are the same at both ends of every
    file. Read in milliseconds: a LoRA-only checkpoint records it and its resume compares it."""
    import os
    import zlib

    if not model_path or not os.path.isdir(model_path):
        return None
    names = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
    names = names or sorted(n for n in os.listdir(model_path) if n.endswith((".bin", ".pt", ".pth")))
    if not names:
        return None
    crc = 0
    for name in names:
        path = os.path.join(model_path, name)
        size = os.path.getsize(path)
        crc = zlib.crc32(f"{name}:{size}".encode(), crc)
        with open(path, "rb") as fh:
            crc = zlib.crc32(fh.read(FINGERPRINT_SPAN), crc)  # a safetensors file's header, then its first tensors
            if size > FINGERPRINT_SPAN:
                fh.seek(max(FINGERPRINT_SPAN, size - FINGERPRINT_SPAN))
                crc = zlib.crc32(fh.read(FINGERPRINT_SPAN), crc)
    return f"{crc:08x}"


def lora_record(lora: LoRASettings | None, fingerprint: str | None) -> dict | None:
    """What a checkpoint's manifest records of the LoRA it was trained with: rank, alpha, and its base's
    fingerprint (:func:`base_fingerprint`) when the base was an HF checkpoint."""
    if lora is None:
        return None
    record: dict = {"rank": lora.rank, "alpha": lora.alpha}
    if fingerprint is not None:
        record["base"] = fingerprint
    return record


def check_lora_record(saved: dict | None, mine: dict | None, lora_only: bool, path: str,
                      model_path: str | None = None) -> None:
    """One CheckpointError line unless a checkpoint of LoRA ``saved`` loads into an engine with LoRA ``mine``:
    the same rank and alpha, and for adapters alone (``lora_only``: the base comes from this engine's HF
    checkpoint) the same base when both recorded one."""
    from verl.utils.checkpoint import CheckpointError

    plain = {k: v for k, v in (saved or {}).items() if k != "base"} if saved is not None else None
    mine_plain = {k: v for k, v in (mine or {}).items() if k != "base"} if mine is not None else None
    if plain != mine_plain and (saved is not None or lora_only):
        raise CheckpointError(f"checkpoint {path}: expected a checkpoint of this actor's LoRA {mine_plain}, found "
                              f"LoRA {plain}")
    base, my_base = (saved or {}).get("base"), (mine or {}).get("base")
    if lora_only and base is not None and my_base is not None and base != my_base:
        raise CheckpointError(f"checkpoint {path}: expected adapters trained on this actor's base model "
                              f"{model_path or ''} (fingerprint {my_base}), found adapters of another base "
                              f"(fingerprint {base}): resume with the model.path it was trained on")


class LoRAError(ConfigError):
    """A LoRA setting or adapter directory that does not fit the model or the engine (an InputError: one line,
    exit 2)."""


@dataclasses.dataclass(frozen=True)
class LoRASettings:
    """One role's LoRA, whatever the backend's keys. ``where``: the dotted key prefix messages name."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    adapter_path: str | None = None
    merge: bool = True
    where: str = "actor_rollout_ref.model"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


def model_key(head: str) -> str:
    """The config section of the model an engine of ``head`` trains: the critic's or the actor's."""
    return "critic.model" if head == "value" else "actor_rollout_ref.model"


def value_head(head: str, rules: BackendConfigRules) -> tuple[str, ...]:
    """The modules that stay trainable beside the adapters: a critic's value head (an LM checkpoint has none,
    so it starts at zero and has to be learnt), by its module name on the backend of ``rules``."""
    return (rules.lora.value_head,) if head == "value" else ()


def in_modules(name: str, modules: Sequence[str]) -> bool:
    """Whether parameter ``name`` belongs to one of ``modules`` (top-level module names)."""
    return any(name.startswith(m + ".") for m in modules)


def trained_names(module: torch.nn.Module) -> set[str]:
    """The parameters a LoRA model trains (adapters, and a critic's value head): a save_lora_only checkpoint's."""
    return {n for n, p in module.named_parameters() if p.requires_grad}


def lora_settings(model: Any, rules: BackendConfigRules, where: str = "actor_rollout_ref.model"
                  ) -> LoRASettings | None:
    """The LoRA a role's ``model`` section (at key ``where``) asks of the backend of ``rules``; None when off.
    Megatron reads the ``lora`` block, FSDP the flat ``lora_*`` keys (as verl): ``rules.lora.block``."""
    if model is None:
        return None
    if rules.lora.block:
        block = model.get("lora") if hasattr(model, "get") else None
        if not block or not block.get("rank"):
            return None
        return LoRASettings(rank=int(block["rank"]), alpha=float(block["alpha"]), dropout=float(block["dropout"]),
                            target_modules=_names(block["target_modules"]),
                            exclude_modules=_names(block["exclude_modules"]), adapter_path=block["adapter_path"],
                            merge=bool(block["merge"]), where=f"{where}.lora")
    rank = model.get("lora_rank") if hasattr(model, "get") else 0
    if not rank:
        return None
    block = model.get("lora") if hasattr(model, "get") else None
    # verl's FSDP engine reads the rollout's choice from the same key as Megatron: model.lora.merge.
    merge = bool(block.get("merge", True)) if block else True
    return LoRASettings(rank=int(rank), alpha=float(model["lora_alpha"]),
                        target_modules=_names(model["target_modules"]),
                        exclude_modules=_names(model["exclude_modules"]), adapter_path=model["lora_adapter_path"],
                        merge=merge, where=where)


def lora_export_options(spec: Any) -> tuple[bool, bool]:
    """(``save_lora_only``, ``export_merged``) of a role's ``checkpoint`` section (the actor's: verl's
    ``actor_rollout_ref.actor.checkpoint.save_lora_only``, verl-hpc's ``checkpoint.export_merged``); both off
    for a role without one."""
    checkpoint = getattr(spec.role, "checkpoint", None) if spec.optim is not None else None
    if checkpoint is None:
        return False, False
    get = checkpoint.get if hasattr(checkpoint, "get") else lambda k, d=None: getattr(checkpoint, k, d)
    return bool(get("save_lora_only", False)), bool(get("export_merged", False))


def check_settings(settings: LoRASettings, rules: BackendConfigRules) -> None:
    """The settings on their own (before any model exists): one :class:`LoRAError` line naming the key."""
    rank_key = "rank" if rules.lora.block else "lora_rank"
    if settings.rank <= 0:
        raise LoRAError(f"{settings.where}.{rank_key}: expected a positive rank with LoRA on (0 turns it off), "
                        f"found {settings.rank}")
    if settings.alpha <= 0:
        key = "alpha" if rules.lora.block else "lora_alpha"
        raise LoRAError(f"{settings.where}.{key}: expected a positive alpha, found {settings.alpha}")
    if not 0 <= settings.dropout < 1:
        raise LoRAError(f"{settings.where}.dropout: expected a value in [0, 1), found {settings.dropout}")
    if not settings.target_modules:
        raise LoRAError(f"{settings.where}.target_modules: expected module names, found none")


def check_lora_config(cfg: Any, model: Any, rules: BackendConfigRules) -> None:
    """The composed config's actor LoRA against ``model`` before any rank starts (:func:`check_lora_section`)."""
    check_lora_section(cfg["actor_rollout_ref"]["model"], "actor_rollout_ref.model", model, rules)


def check_lora_section(arr: Any, where: str, model: Any, rules: BackendConfigRules) -> None:
    """One role's ``model`` section (at key ``where``) against its ``model``: rank, alpha, the other backend's
    keys set instead, targets that match nothing, MoE, and an adapter directory that does not fit."""
    block = arr.get("lora") or {}
    keys = rules.lora
    if keys.block and arr.get("lora_rank") and not block.get("rank"):
        raise LoRAError(f"{where}.lora_rank: LoRA on the {keys.name} strategy reads verl's lora block: set "
                        f"{where}.lora.rank (and lora.alpha, lora.target_modules) instead")
    if not keys.block and block.get("rank") and not arr.get("lora_rank"):
        raise LoRAError(f"{where}.lora.rank: LoRA on the {keys.name} strategy reads verl's flat keys: "
                        f"set {where}.lora_rank (and lora_alpha, target_modules) instead")
    settings = lora_settings(arr, rules, where)
    if settings is None:
        return
    check_settings(settings, rules)
    if model.is_moe:
        raise LoRAError(f"{settings.where}: LoRA on MoE models is not implemented (adapters on the experts' grouped "
                        "linears under expert parallelism): use a dense model or LoRA off")
    names = rules.lora_candidate_modules(model)
    if settings.target_modules != ("all-linear",) or not keys.all_linear_keyword:
        found = [n for n in names if matches(n, settings.target_modules) and not matches(n, settings.exclude_modules)]
    else:
        found = [n for n in names if not matches(n, settings.exclude_modules)]
    if not found:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise LoRAError(f"{settings.where}.target_modules: expected modules of the model ({', '.join(leaves)} or "
                        f"patterns of full names), found none matching {list(settings.target_modules)}"
                        + (f" minus exclude_modules {list(settings.exclude_modules)}" if settings.exclude_modules
                           else ""))
    if settings.adapter_path:
        from verl.engine.lora.peft_io import read_adapter

        read_adapter(settings.adapter_path, settings, arr["path"])


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether module ``name`` is one ``patterns`` names: its last component, or the whole name by fnmatch."""
    leaf = name.rsplit(".", 1)[-1]
    return any(p == leaf or p == name or fnmatch.fnmatchcase(name, p) for p in patterns)


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def hf_base_name(name: str) -> str:
    """The HF tensor name of a PEFT-wrapped base parameter (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


def adapter_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if is_adapter_name(n)}


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module) -> Iterator[None]:
    """The base model: every LoRA layer of ``module`` (ours or PEFT's) off inside the block, on again after it,
    so the reference policy's log-probs are the base checkpoint's without a second copy of the model."""
    layers = [m for m in module.modules() if hasattr(m, "disable_adapters") and hasattr(m, "lora_A")]
    saved = [m.disable_adapters for m in layers]
    try:
        for m in layers:
            _set_disabled(m, True)
        yield
    finally:
        for m, was in zip(layers, saved, strict=True):
            _set_disabled(m, was)


def _set_disabled(layer: torch.nn.Module, disabled: bool) -> None:
    # PEFT's layers expose disable_adapters as a read-only property over _disable_adapters.
    if hasattr(layer, "_disable_adapters"):
        layer._disable_adapters = disabled
    else:
        layer.disable_adapters = disabled


def has_adapters(module: torch.nn.Module) -> bool:
    return any(is_adapter_name(n) for n, _ in module.named_parameters())
