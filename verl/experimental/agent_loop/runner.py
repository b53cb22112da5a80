"""Many trajectories at once over one server manager: what a rollout replica runs for a batch of prompts.

``AgentLoopRunner.generate(rows, sampling_params)`` starts one agent loop per row (its ``agent_name`` or
``rollout.agent.default_agent_loop``) as an asyncio task, so one trajectory's tool calls overlap the others'
generation, and returns the per-row outputs plus verl's metrics (``num_turns/*``, ``tool_call_counts/*``,
``agent_loop/*``). ``pad_outputs`` turns the outputs into the trainer's batch tensors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl.engine.rollout.partial import AGENT_REWARD_COLUMNS, last_token_scores
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopOutput,
    DictConfigWrap,
    ToolListWrap,
    cfg_get,
    check_agent_names,
    instantiate_agent_loop,
    load_agent_loop_config,
)
from verl.tools.concurrency import LoopSemaphore
from verl.tools.tool_registry import load_all_tools


@dataclass
class AgentLoopBatch:
    outputs: list[AgentLoopOutput]
    metrics: dict[str, float]


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{prefix}/min": float(min(values)), f"{prefix}/max": float(max(values)),
            f"{prefix}/mean": float(sum(values) / len(values))}


def batch_metrics(outputs: list[AgentLoopOutput]) -> dict[str, float]:
    """verl's names: ``num_turns/{min,max,mean}``, ``tool_call_counts/{min,max,mean}``,
    ``agent_loop/{generate_sequences,tool_calls}/{min,max,mean}`` (seconds per trajectory)."""
    metrics = _stats("num_turns", [o.num_turns for o in outputs])
    metrics |= _stats("tool_call_counts", [o.extra_fields.get("tool_call_counts", 0) for o in outputs])
    metrics |= _stats("tool_call_errors", [o.extra_fields.get("tool_call_errors", 0) for o in outputs])
    metrics |= _stats("agent_loop/generate_sequences", [o.metrics.generate_sequences for o in outputs])
    metrics |= _stats("agent_loop/tool_calls", [o.metrics.tool_calls for o in outputs])
    return metrics


class AgentLoopRunner:
    """Runs agent loops for batches of rows; tools and custom loops are loaded once, here."""

    def __init__(self, config: Any, server_manager: Any, tokenizer: Any, processor: Any = None,
                 dataset_cls: Any = None, data_config: Any = None, tools: list | None = None,
                 max_concurrency: int | None = None):
        self.config = config
        rollout = cfg_get(config, "actor_rollout_ref.rollout", {})
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = data_config if data_config is not None else cfg_get(config, "data", {})
        if tools is None:
            tools = load_all_tools(cfg_get(rollout, "multi_turn.tool_config_path"),
                                   cfg_get(rollout, "multi_turn.function_tool_path"))
        self.tools = tools
        path = cfg_get(rollout, "agent.agent_loop_config_path")
        if path:
            load_agent_loop_config(path)
        self.default_agent_loop = str(cfg_get(rollout, "agent.default_agent_loop", "single_turn_agent"))
        check_agent_names([self.default_agent_loop])
        # per event loop: generate_sync runs each batch under a new asyncio.run
        self._slots = LoopSemaphore(max_concurrency) if max_concurrency else None

    def agent_names(self, rows: list[Mapping[str, Any]]) -> list[str]:
        names = [str(row.get("agent_name") or self.default_agent_loop) for row in rows]
        check_agent_names(names)
        return names

    async def run_one(self, row: Mapping[str, Any], sampling_params: dict[str, Any],
                      agent_name: str | None = None, server_manager: Any = None) -> AgentLoopOutput:
        """One trajectory; ``server_manager``: this trajectory's own (default: the runner's)."""
        kwargs = {k: v for k, v in row.items() if k != "agent_name"}
        loop = instantiate_agent_loop(
            agent_name or str(row.get("agent_name") or self.default_agent_loop),
            trainer_config=DictConfigWrap(self.config),
            server_manager=self.server_manager if server_manager is None else server_manager,
            tokenizer=self.tokenizer, processor=self.processor, dataset_cls=self.dataset_cls,
            data_config=DictConfigWrap(self.data_config), tools=ToolListWrap(self.tools))
        if self._slots is None:
            return await loop.run(dict(sampling_params), **kwargs)
        async with self._slots:
            return await loop.run(dict(sampling_params), **kwargs)

    async def generate(self, rows: list[Mapping[str, Any]], sampling_params: dict[str, Any]) -> AgentLoopBatch:
        names = self.agent_names(rows)  # every name checked before any trajectory starts
        pairs = zip(rows, names, strict=True)
        outputs = await asyncio.gather(*(self.run_one(row, sampling_params, name) for row, name in pairs))
        return AgentLoopBatch(outputs=list(outputs), metrics=batch_metrics(outputs))

    def generate_sync(self, rows: list[Mapping[str, Any]], sampling_params: dict[str, Any]) -> AgentLoopBatch:
        return asyncio.run(self.generate(rows, sampling_params))


# The per-trajectory fields the reward reads (non-tensor columns, verl's names): the loop's turn count and its tools'
# rewards (``execute``'s in call order, ``calc_reward`` per tool), passed to compute_score in extra_info.
REWARD_COLUMNS = AGENT_REWARD_COLUMNS


def agent_rewards(out: AgentLoopOutput) -> dict[str, Any]:
    """What an agent loop's output brings to the reward, as the replay buffer keeps it: verl's columns (the turn
    count, the tools' ``execute`` rewards in call order, each tool's ``calc_reward``) and the loop's own score."""
    return {"__num_turns__": int(out.num_turns),
            "tool_rewards": [float(r) for r in out.extra_fields.get("tool_rewards") or []],
            "reward_scores": {str(k): float(v) for k, v in (out.extra_fields.get("reward_scores") or {}).items()},
            "reward_score": None if out.reward_score is None else float(out.reward_score)}


def reward_columns(outputs: list[AgentLoopOutput]):
    """``{column: object array}`` of :data:`REWARD_COLUMNS` for a batch's outputs (empty lists and dicts where a
    loop recorded none)."""
    import numpy as np

    rows = [agent_rewards(o) for o in outputs]
    columns = {}
    for key in REWARD_COLUMNS:
        columns[key] = np.empty(len(rows), dtype=object)
        columns[key][:] = [r[key] for r in rows]
    return columns


def pad_outputs(outputs: list[AgentLoopOutput], prompt_length: int, response_length: int, pad_token_id: int):
    """The trainer's tensors (verl's layout): ``prompts`` left-padded, ``responses`` / ``response_mask`` /
    ``rollout_log_probs`` right-padded, ``input_ids``, ``attention_mask``, ``position_ids``; ``rm_scores`` (the
    score on each response's last token) when every loop scored its own trajectory (``reward_score``, verl's
    rule; some but not all is refused in one line)."""
    import torch

    rm_scores = last_token_scores([o.reward_score for o in outputs], [len(o.response_ids) for o in outputs],
                                  response_length, "AgentLoopOutput.reward_score")
    b = len(outputs)
    prompts = torch.full((b, prompt_length), pad_token_id, dtype=torch.long)
    responses = torch.full((b, response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((b, response_length), dtype=torch.long)
    logprobs = torch.zeros((b, response_length), dtype=torch.float32)
    attention = torch.zeros((b, prompt_length + response_length), dtype=torch.long)
    for i, o in enumerate(outputs):
        p, r = o.prompt_ids[-prompt_length:], o.response_ids[:response_length]
        if p:
            prompts[i, prompt_length - len(p):] = torch.tensor(p)
            attention[i, prompt_length - len(p):prompt_length] = 1
        if r:
            responses[i, :len(r)] = torch.tensor(r)
            response_mask[i, :len(r)] = torch.tensor(o.response_mask[:len(r)])
            attention[i, prompt_length:prompt_length + len(r)] = 1
            if o.response_logprobs is not None:
                logprobs[i, :len(r)] = torch.tensor(o.response_logprobs[:len(r)])
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    out = {"prompts": prompts, "responses": responses, "response_mask": response_mask,
           "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention,
           "position_ids": position_ids}
    if outputs and all(o.response_logprobs is not None for o in outputs):
        out["rollout_log_probs"] = logprobs
    if rm_scores is not None:
        out["rm_scores"] = rm_scores
    return out
