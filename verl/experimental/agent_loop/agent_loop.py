"""verl's agent-loop contract: ``AgentLoopBase``, ``AgentLoopOutput``, the ``@register(name)`` registry.

An agent loop runs one trajectory: it talks to a token-in/token-out ``server_manager`` (``await
server_manager.generate(request_id=, prompt_ids=, sampling_params=)`` -> an object with ``token_ids`` and
``log_probs``; one ``request_id`` per trajectory so the engine can keep its KV cache across turns) and returns
an :class:`AgentLoopOutput`. Loops are built as verl builds them: ``cls(trainer_config=DictConfigWrap(config),
server_manager=..., tokenizer=..., processor=..., dataset_cls=..., data_config=DictConfigWrap(data),
tools=ToolListWrap(tools), **extra keys of its registry entry)``.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from verl.errors import InputError

logger = logging.getLogger(__name__)


class AgentLoopMetrics(BaseModel):
    """Seconds one trajectory spent generating and in tools (verl's per-trajectory timings)."""

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(BaseModel):
    """One trajectory. ``response_mask`` is 1 on tokens the model sampled, 0 on tool / user tokens;
    ``response_logprobs`` (when the server returns them) is aligned with ``response_ids`` (0.0 on mask-0
    tokens)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics = AgentLoopMetrics()
    extra_fields: dict[str, Any] = {}


class TokenOutput(BaseModel):
    """What a server manager's ``generate`` returns (verl's ``TokenOutput``)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = {}


class DictConfigWrap:
    """verl's wrapper that keeps a config from being resolved by the instantiation of the loop."""

    def __init__(self, config: Any):
        self.config = config


class ToolListWrap:
    def __init__(self, tools: list):
        self.tools = tools


def cfg_get(node: Any, path: str, default: Any = None) -> Any:
    """``node.a.b`` for an OmegaConf node, a dataclass or a dict alike; ``default`` when a key is missing or
    None."""
    for key in path.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping):
            node = node.get(key)
        else:
            node = getattr(node, key, None)
    return default if node is None else node


class AgentLoopBase(ABC):
    """Base of an agent loop (verl's constructor signature; ``**kwargs`` takes the registry entry's extras)."""

    def __init__(self, trainer_config: DictConfigWrap | Any, server_manager: Any, tokenizer: Any,
                 processor: Any = None, dataset_cls: Any = None, data_config: DictConfigWrap | Any = None,
                 **kwargs: Any):
        self.config = trainer_config.config if isinstance(trainer_config, DictConfigWrap) else trainer_config
        self.rollout_config = cfg_get(self.config, "actor_rollout_ref.rollout", {})
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = data_config.config if isinstance(data_config, DictConfigWrap) else (data_config or {})
        self.apply_chat_template_kwargs = dict(cfg_get(self.data_config, "apply_chat_template_kwargs", {}))
        self.prompt_length = int(cfg_get(self.rollout_config, "prompt_length", 1024))
        self.response_length = int(cfg_get(self.rollout_config, "response_length", 1024))

    def cap_prompt(self, prompt_ids: list[int]) -> list[int]:
        """Left-truncate a prompt to ``rollout.prompt_length`` (verl's rule; the tail is what the model answers)."""
        if len(prompt_ids) > self.prompt_length:
            logger.warning("prompt of %d tokens exceeds rollout.prompt_length=%d; left-truncating",
                           len(prompt_ids), self.prompt_length)
            return prompt_ids[-self.prompt_length:]
        return prompt_ids

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One trajectory from a dataset row (``raw_prompt``, ``extra_info``, ``tools_kwargs``, ...)."""


def token_output(raw: Any) -> TokenOutput:
    """A server's answer as :class:`TokenOutput` (accepts it, a dict, or any object with ``token_ids``)."""
    if isinstance(raw, TokenOutput):
        return raw
    if isinstance(raw, Mapping):
        return TokenOutput(**raw)
    return TokenOutput(token_ids=list(raw.token_ids), log_probs=getattr(raw, "log_probs", None),
                       stop_reason=getattr(raw, "stop_reason", None),
                       num_preempted=getattr(raw, "num_preempted", None),
                       extra_fields=dict(getattr(raw, "extra_fields", None) or {}))


# agent_name -> {"_target_": "module.Class", **extra constructor kwargs} (verl's registry entries)
_agent_loop_registry: dict[str, dict[str, Any]] = {}


def register(agent_name: str):
    """Class decorator: make the loop available as ``agent_name`` (dataset rows' ``agent_name``)."""

    def decorator(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        _agent_loop_registry[agent_name] = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
        return cls

    return decorator


def registered_agent_loops() -> list[str]:
    return sorted(_agent_loop_registry)


def load_agent_loop_config(path: str) -> list[str]:
    """Register the loops of ``rollout.agent.agent_loop_config_path`` (a YAML list of ``{name, _target_,
    ...extra kwargs}``); returns their names."""
    from verl.utils.yaml_io import read_yaml_file

    entries = read_yaml_file(path, "agent_loop_config_path")
    if not isinstance(entries, list):
        raise InputError(f"agent_loop_config_path {path}: expected a list of {{name, _target_}} entries")
    names = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("_target_"):
            raise InputError(f"agent_loop_config_path {path}: entry {i} needs 'name' and '_target_'")
        _resolve_target(entry["_target_"], f"agent_loop_config_path {path}: entry {i}")
        _agent_loop_registry[str(entry["name"])] = {k: v for k, v in entry.items() if k != "name"}
        names.append(str(entry["name"]))
    return names


def _resolve_target(target: str, where: str) -> type:
    module_name, _, attr = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise InputError(f"{where}: cannot import {target}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
        raise InputError(f"{where}: {target} is not an AgentLoopBase subclass")
    return cls


def check_agent_names(names) -> None:
    """``InputError`` (one line) for an ``agent_name`` that no loop is registered under."""
    unknown = sorted({str(n) for n in names} - set(_agent_loop_registry))
    if unknown:
        raise InputError(f"agent_name {unknown[0]!r} is not a registered agent loop "
                         f"(registered: {registered_agent_loops()})")


def instantiate_agent_loop(agent_name: str, **kwargs: Any) -> AgentLoopBase:
    """Build the loop registered as ``agent_name`` with verl's constructor arguments."""
    check_agent_names([agent_name])
    entry = dict(_agent_loop_registry[agent_name])
    cls = _resolve_target(entry.pop("_target_"), f"agent loop {agent_name!r}")
    return cls(**kwargs, **entry)
