"""The FSDP backend's config rules (``strategy: fsdp | fsdp2``): every rank is a DP rank on one device mesh of
``fsdp_size`` ranks per process. Torch-free (see :mod:`verl.engine.config_rules`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl.engine.config_rules import ARR, BackendConfigRules, LoRAKeys, MemoryLayout, check_divides
from verl.utils.config_checks import ConfigError


class FSDPConfigRules(BackendConfigRules):
    sections = ("fsdp_config", "grad_clip")
    lora = LoRAKeys(name="fsdp", block=False, value_head="score", all_linear_keyword=True)

    def lora_candidate_modules(self, model: Any) -> list[str]:
        """The HF model's 2-D layer weights (PEFT's names)."""
        from verl.models.spec.registry import model_spec

        return [n.removesuffix(".weight") for n, shape in model_spec(model.model_type).hf_shapes(model).items()
                if len(shape) == 2 and n.endswith(".weight") and ".layers." in n]

    def model_parallel_sizes(self, actor: Mapping[str, Any]) -> tuple[int, int]:
        return 1, 1

    def check_layout(self, cfg: Mapping[str, Any], model: Any, world: int) -> None:
        actor = cfg[ARR]["actor"]
        if model.is_moe:
            raise ConfigError(f"{ARR}.actor.strategy: expected megatron for the MoE model {model.model_type} (FSDP "
                              f"here trains dense models: transformers fuses the experts), found {actor['strategy']!r}")
        fsdp_size = actor["fsdp_config"]["fsdp_size"]
        if fsdp_size not in (-1, 0) and fsdp_size < world:
            check_divides(f"{ARR}.actor.fsdp_config.fsdp_size", fsdp_size, "trainer.nnodes * trainer.n_gpus_per_node",
                          world)
        elif fsdp_size == 0:
            raise ConfigError(f"{ARR}.actor.fsdp_config.fsdp_size: expected -1 (every rank) or a divisor of the "
                              f"world size {world}, found 0")
        from verl.engine.lora import check_lora_config  # LoRA's keys against the model (imports torch: here)

        check_lora_config(cfg, model, self)

    def check_role_layouts(self, cfg: Mapping[str, Any], sections: Mapping[str, Any]) -> None:
        """One device mesh per process: one ``fsdp_size``. The rollout dtype may differ from FSDP's master dtype
        (the reshard casts this rank's shards, never the full model)."""
        size = cfg[ARR]["actor"]["fsdp_config"]["fsdp_size"]
        for name, section in sections.items():
            if section["fsdp_config"]["fsdp_size"] != size:
                raise ConfigError(f"{name}.fsdp_config.fsdp_size: expected the actor's {size} (one device mesh per "
                                  f"process), found {section['fsdp_config']['fsdp_size']}")

    def memory_estimate(self, cfg: Mapping[str, Any], dp: int) -> str:
        return "estimated memory per rank: printed for the megatron strategy only"

    def memory_layout(self, cfg: Mapping[str, Any]) -> MemoryLayout:
        """FSDP shards the parameters, gradients and Adam state over every rank; counted as a sharded optimizer
        with whole weights (an upper bound of the state at the moment the update's activations peak)."""
        from verl.utils.torch_dtypes import SHORT_NAMES

        dtype = str(cfg[ARR]["actor"]["fsdp_config"].get("model_dtype") or "float32")
        return MemoryLayout(dtype=SHORT_NAMES.get(dtype, dtype))


RULES = FSDPConfigRules()
