"""Any HF model as a role of the Python API (document 000): ``HFActor`` / ``HFCritic`` name the model a DataFlow or a
DataPipeline trains, by the keys `verl train` reads (``actor_rollout_ref.model.*``, ``critic.model.*``).

    actor = HFActor.from_pretrained("path/to/model")                  # an HF directory (or a config.json)
    actor = HFActor.from_pretrained(PeftModel.from_pretrained(base, adapter_dir))   # base + its LoRA adapter
    critic = HFCritic.from_pretrained("path/to/model")

An object is a name for the weights, not a second copy of them: the trainer's engines load them (Megatron or FSDP).
A ``PeftModel`` becomes its base model's directory and its adapter, written next to nothing of the user's (a
temporary directory): verl's LoRA keys (``lora_rank``, ``lora_alpha``, ``target_modules``, ``lora_adapter_path``),
trained by the FSDP strategy whose LoRA is PEFT's. A transformers model held in memory is written out first, so
weights changed since it was loaded are the ones trained.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, ClassVar

from verl.errors import InputError


@dataclasses.dataclass(frozen=True)
class HFModel:
    """An HF model by the keys verl reads: ``path`` (an HF directory or a config.json), ``tokenizer`` (default: the
    model's directory), ``lora`` (verl's flat LoRA keys, from a PeftModel) and ``strategy`` (None: the trainer's)."""

    path: str
    tokenizer: str | None = None
    lora: dict[str, Any] | None = None
    strategy: str | None = None
    role: ClassVar[str] = "model"

    @classmethod
    def from_pretrained(cls, model: Any, tokenizer: str | None = None, *, strategy: str | None = None) -> HFModel:
        """``model``: a local HF directory or config.json, a ``peft.PeftModel`` (LoRA) or a transformers
        ``PreTrainedModel``."""
        if isinstance(model, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(model))
            if not (os.path.isfile(os.path.join(path, "config.json")) or
                    (os.path.isfile(path) and path.endswith(".json"))):
                raise InputError(f"{cls.__name__}.from_pretrained: expected an HF model directory (config.json) or a "
                                 f"config.json, found nothing at {path}")
            return cls(path, tokenizer, None, strategy)
        if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
            return cls._from_peft(model, tokenizer, strategy)
        if hasattr(model, "save_pretrained") and hasattr(model, "config"):
            out = tempfile.mkdtemp(prefix=f"verl_{cls.role}_")
            model.save_pretrained(out)
            source = getattr(model, "name_or_path", "") or ""
            return cls(out, tokenizer or (source if os.path.isdir(source) else None), None, strategy)
        raise InputError(f"{cls.__name__}.from_pretrained: expected a model directory, a PeftModel or a transformers "
                         f"model, found {type(model).__name__}")

    @classmethod
    def _from_peft(cls, model: Any, tokenizer: str | None, strategy: str | None) -> HFModel:
        name = getattr(model, "active_adapter", None) or "default"
        name = name if isinstance(name, str) else name[0]
        config = model.peft_config[name]
        peft_type = str(getattr(config, "peft_type", ""))
        if not peft_type.endswith("LORA"):
            raise InputError(f"{cls.__name__}.from_pretrained(PeftModel): expected a LoRA adapter, found {peft_type}")
        base = config.base_model_name_or_path or getattr(model.get_base_model(), "name_or_path", None)
        if not base or not os.path.isfile(os.path.join(base, "config.json")):
            raise InputError(f"{cls.__name__}.from_pretrained(PeftModel): expected the adapter's base model as a "
                             f"local HF directory (base_model_name_or_path), found {base!r}")
        adapter = tempfile.mkdtemp(prefix=f"verl_{cls.role}_adapter_")
        model.save_pretrained(adapter, selected_adapters=[name])
        written = os.path.join(adapter, name) if name != "default" else adapter
        targets = config.target_modules
        lora = {"lora_rank": int(config.r), "lora_alpha": int(config.lora_alpha),
                "target_modules": targets if isinstance(targets, str) else sorted(targets),
                "lora_adapter_path": written}
        # the strategy is checked where the trainer is configured (verl.engine.strategies.peft_strategy)
        return cls(os.path.abspath(base), tokenizer, lora, strategy)

    @property
    def tokenizer_path(self) -> str:
        if self.tokenizer:
            return self.tokenizer
        return os.path.dirname(self.path) if os.path.isfile(self.path) else self.path

    def model_keys(self, prefix: str) -> dict[str, Any]:
        """The dotted verl keys naming this model under ``prefix`` (``actor_rollout_ref.model`` or
        ``critic.model``)."""
        keys = {f"{prefix}.path": self.path}
        for key, value in (self.lora or {}).items():
            keys[f"{prefix}.{key}"] = value
        return keys


class HFActor(HFModel):
    """The policy: the model a DataFlow's rollout samples from and PPO trains (``actor_rollout_ref.model``)."""

    role: ClassVar[str] = "actor"


class HFCritic(HFModel):
    """The value model of PPO with GAE (``critic.model``)."""

    role: ClassVar[str] = "critic"
