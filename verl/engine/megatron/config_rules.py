"""The Megatron backend's config rules (``strategy: megatron``): the actor's (t, p, d) and expert layout, shared
by every colocated role through one parallel state per process. Torch-free at import (see
:mod:`verl.engine.config_rules`); the layout check imports the model builder's rules when it runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl.engine.config_rules import ARR, BackendConfigRules, LoRAKeys, MemoryLayout, check_divides
from verl.utils.config_checks import ConfigError

LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "dtype")


class MegatronConfigRules(BackendConfigRules):
    sections = ("megatron",)
    lora = LoRAKeys(name="megatron", block=True, value_head="output_layer", all_linear_keyword=False)

    def lora_candidate_modules(self, model: Any) -> list[str]:
        """Megatron's linears, by global layer number."""
        from verl.models.mcore.weights import weight_rules

        return [r.mcore.removesuffix(".weight") for r in weight_rules(model, 1, 0)
                if r.mcore.rsplit(".", 2)[-2].startswith("linear_") and r.mcore.endswith(".weight")]

    def model_parallel_sizes(self, actor: Mapping[str, Any]) -> tuple[int, int]:
        mega = actor["megatron"]
        return mega["tensor_model_parallel_size"], mega["pipeline_model_parallel_size"]

    def check_layout(self, cfg: Mapping[str, Any], model: Any, world: int) -> None:
        from verl.models.mcore.model import ModelLayoutError, check_megatron_block, check_parallel_layout

        mega = cfg[ARR]["actor"]["megatron"]
        tp, pp = self.model_parallel_sizes(cfg[ARR]["actor"])
        prefix = f"{ARR}.actor.megatron."
        try:
            check_megatron_block(model)
            check_parallel_layout(model, tp, pp, mega["expert_model_parallel_size"],
                                  mega["expert_tensor_parallel_size"], world_size=world)
        except ModelLayoutError as err:
            raise ConfigError(f"{prefix}{err}") from None
        if model.is_moe and tp > 1 and not mega["sequence_parallel"]:
            raise ConfigError(f"{prefix}sequence_parallel: expected true for the MoE model with "
                              f"tensor_model_parallel_size={tp} (megatron trains MoE under TP only with sequence "
                              "parallelism), found false")
        check_divides(prefix + "tensor_model_parallel_size * pipeline_model_parallel_size", tp * pp,
                      "trainer.nnodes * trainer.n_gpus_per_node", world)
        from verl.engine.lora import check_lora_config  # LoRA's keys against the model (imports torch: here)

        check_lora_config(cfg, model, self)

    def check_role_layouts(self, cfg: Mapping[str, Any], sections: Mapping[str, Any]) -> None:
        """One Megatron parallel state per process: the roles' (tp, pp) and dtype are the actor's, and so is
        the rollout's dtype (the 3D-HybridEngine copies the training bytes as they are)."""
        actor = cfg[ARR]["actor"]["megatron"]
        for name, section in sections.items():
            mega = section["megatron"]
            # The reward model's section has no expert keys: a dense model ignores the process's expert groups.
            for key in LAYOUT_KEYS + (("expert_model_parallel_size",) if "expert_model_parallel_size" in mega else ()):
                if mega[key] != actor[key]:
                    raise ConfigError(f"{name}.megatron.{key}: expected the actor's {actor[key]!r} (colocated roles "
                                      f"share one Megatron parallel state per process), found {mega[key]!r}")
        rollout_dtype = cfg[ARR]["rollout"]["dtype"]
        if rollout_dtype != actor["dtype"]:
            raise ConfigError(f"{ARR}.rollout.dtype: expected {ARR}.actor.megatron.dtype={actor['dtype']!r} (the "
                              f"reshard copies training bytes into the rollout in place), found {rollout_dtype!r}")

    def memory_estimate(self, cfg: Mapping[str, Any], dp: int) -> str:
        from verl.models.config import ModelConfig
        from verl.models.memory import estimate_rank_memory
        from verl.utils.torch_dtypes import DTYPES

        arr = cfg[ARR]
        layout = self.memory_layout(cfg)
        tp, pp = self.model_parallel_sizes(arr["actor"])
        estimate = estimate_rank_memory(
            ModelConfig.from_pretrained(arr["model"]["path"]), tp=tp, pp=pp, dp=dp, ep=layout.ep, etp=layout.etp,
            dtype_bytes=DTYPES[layout.dtype].itemsize, distributed_optimizer=layout.distributed_optimizer,
            rollout_tp=arr["rollout"]["tensor_model_parallel_size"],
            rollout_dtype_bytes=DTYPES[arr["rollout"]["dtype"]].itemsize)
        return f"{estimate.summary()} (tp={tp} pp={pp} ep={layout.ep})"

    def memory_layout(self, cfg: Mapping[str, Any]) -> MemoryLayout:
        mega = cfg[ARR]["actor"]["megatron"]
        return MemoryLayout(dtype=mega["dtype"], sequence_parallel=bool(mega.get("sequence_parallel", False)),
                            ep=mega["expert_model_parallel_size"], etp=mega["expert_tensor_parallel_size"],
                            distributed_optimizer=bool(mega["use_distributed_optimizer"]))


RULES = MegatronConfigRules()
