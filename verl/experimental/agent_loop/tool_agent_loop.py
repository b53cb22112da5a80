"""``tool_agent``: verl's ReAct state machine over token ids.

generate -> parse tool calls -> run them (at most ``max_parallel_calls`` per turn, concurrently) -> append the
tool messages as chat-template deltas -> generate ... until a turn has no call, ``max_assistant_turns`` or
``max_user_turns`` is reached, or the response budget (``rollout.response_length``) is spent. Every tool
outcome is a tool message: an unknown tool, unreadable arguments, a raising tool or one past
``multi_turn.tool_timeout_s`` tell the model what went wrong and the trajectory goes on. Those, and the calls of
a turn beyond ``max_parallel_calls`` (not run, as in verl), count in ``tool_call_errors``: nothing the model
writes raises out of the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import Enum
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    ToolListWrap,
    cfg_get,
    register,
    token_output,
)
from verl.experimental.agent_loop.chat_template import Trajectory
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser, loads
from verl.tools.function_tool import FunctionTool, normalize_function_tool_return
from verl.tools.schemas import ToolResponse

logger = logging.getLogger(__name__)
CANCEL_GRACE_S = 5.0  # how long a tool cancelled at multi_turn.tool_timeout_s may take to clean up


class AgentState(Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


def truncate_tool_text(text: str, limit: int, side: str) -> str:
    """verl's rule: ``left`` keeps the end, ``right`` the start, ``middle`` both ends."""
    if limit is None or limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class AgentData:
    """One trajectory's state; tools receive it as ``agent_data`` (``extra_fields`` is theirs to use)."""

    def __init__(self, trajectory: Trajectory, request_id: str, tools_kwargs: dict[str, Any]):
        self.trajectory = trajectory
        self.messages = trajectory.messages
        self.request_id = request_id
        self.tools_kwargs = tools_kwargs
        self.metrics = AgentLoopMetrics()
        self.turn_scores: list[float] = []
        self.tool_rewards: list[float] = []
        self.reward_scores: dict[str, float] = {}  # each tool's calc_reward after its last call (verl's key)
        self.tool_calls: list[FunctionCall] = []
        self.user_turns = 0
        self.assistant_turns = 0
        self.tool_call_count = 0
        self.tool_error_count = 0
        self.extra_fields: dict[str, Any] = {}


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, tools: ToolListWrap | list | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        mt = cfg_get(self.rollout_config, "multi_turn", {})
        self.max_user_turns = cfg_get(mt, "max_user_turns")
        self.max_assistant_turns = cfg_get(mt, "max_assistant_turns")
        self.max_parallel_calls = int(cfg_get(mt, "max_parallel_calls", 1))
        self.max_tool_response_length = int(cfg_get(mt, "max_tool_response_length", 256))
        self.tool_response_truncate_side = str(cfg_get(mt, "tool_response_truncate_side", "middle"))
        timeout = cfg_get(mt, "tool_timeout_s")  # null (or absent): no limit
        self.tool_timeout_s = float(timeout) if timeout is not None else None
        tool_list = tools.tools if isinstance(tools, ToolListWrap) else list(tools or [])
        self.tools = {tool.name: tool for tool in tool_list}
        self.tool_schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in tool_list]
        self.tool_parser = ToolParser.get_tool_parser(str(cfg_get(mt, "format", "hermes")), self.tokenizer)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        extra_info = kwargs.get("extra_info") or {}
        tools_kwargs = kwargs.get("tools_kwargs") or extra_info.get("tools_kwargs") or {}
        trajectory = Trajectory(self.tokenizer, list(kwargs["raw_prompt"]), self.tool_schemas,
                                **self.apply_chat_template_kwargs)
        trajectory.prompt_ids = self.cap_prompt(trajectory.prompt_ids)
        data = AgentData(trajectory, uuid4().hex, dict(tools_kwargs))
        state = AgentState.GENERATING
        while state != AgentState.TERMINATED:
            if state == AgentState.GENERATING:
                state = await self._generate(data, sampling_params)
            else:
                state = await self._process_tools(data)

        n = self.response_length
        extra = dict(data.extra_fields)
        extra.update(turn_scores=data.turn_scores, tool_rewards=data.tool_rewards, reward_scores=data.reward_scores,
                     tool_call_counts=data.tool_call_count, tool_call_errors=data.tool_error_count)
        return AgentLoopOutput(
            prompt_ids=trajectory.prompt_ids, response_ids=trajectory.response_ids[:n],
            response_mask=trajectory.response_mask[:n],
            response_logprobs=trajectory.response_logprobs[:n] if trajectory.has_logprobs else None,
            num_turns=data.user_turns + data.assistant_turns + 1, metrics=data.metrics, extra_fields=extra)

    async def _generate(self, data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        traj = data.trajectory
        budget = self.response_length - len(traj.response_ids)
        if budget <= 0:
            return AgentState.TERMINATED
        params = dict(sampling_params)
        params["max_tokens"] = min(int(params.get("max_tokens", budget)), budget)
        if self.tool_parser.stop_token_ids:
            params["stop_token_ids"] = sorted(set(params.get("stop_token_ids") or []) |
                                              set(self.tool_parser.stop_token_ids))
        start = time.perf_counter()
        out = token_output(await self.server_manager.generate(request_id=data.request_id, prompt_ids=traj.all_ids,
                                                              sampling_params=params))
        data.metrics.generate_sequences += time.perf_counter() - start
        if out.num_preempted is not None:
            data.metrics.num_preempted = max(data.metrics.num_preempted, 0) + out.num_preempted
        for key, value in out.extra_fields.items():
            data.extra_fields.setdefault(key, value)
        text = traj.append_model_tokens(out.token_ids, out.log_probs)
        data.assistant_turns += 1

        if len(traj.response_ids) >= self.response_length:
            return AgentState.TERMINATED
        if self.max_assistant_turns and data.assistant_turns >= self.max_assistant_turns:
            return AgentState.TERMINATED
        if self.max_user_turns and data.user_turns >= self.max_user_turns:
            return AgentState.TERMINATED
        content, calls = self.tool_parser.parse_text(text)
        data.tool_calls = calls[:self.max_parallel_calls]
        if len(calls) > self.max_parallel_calls:  # dropped unanswered, as in verl, but counted
            dropped = len(calls) - self.max_parallel_calls
            data.tool_call_count += dropped
            data.tool_error_count += dropped
        traj.messages.append(self._assistant_message(content, data.tool_calls))
        return AgentState.PROCESSING_TOOLS if data.tool_calls else AgentState.TERMINATED

    @staticmethod
    def _assistant_message(content: str, calls: list[FunctionCall]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        tool_calls = []
        for call in calls:
            # always a mapping: templates iterate ``arguments|items``; the model's own text is already in its tokens,
            # and this message is only rendered to find the next messages' delta
            try:
                arguments = loads(call.arguments)
            except ValueError:
                arguments = {}
            if not isinstance(arguments, dict):
                arguments = {}
            entry: dict[str, Any] = {"type": "function", "function": {"name": call.name, "arguments": arguments}}
            if call.tool_call_id is not None:
                entry["id"] = call.tool_call_id
            tool_calls.append(entry)
        if tool_calls:
            message["tool_calls"] = tool_calls
        return message

    async def _process_tools(self, data: AgentData) -> AgentState:
        start = time.perf_counter()
        results = await asyncio.gather(*(self._call_tool(call, data) for call in data.tool_calls))
        data.metrics.tool_calls += time.perf_counter() - start
        messages = []
        for call, (response, reward, _metrics) in zip(data.tool_calls, results, strict=True):
            # a lone surrogate (a JSON "\ud800" escape echoed by a tool) cannot be tokenized: it becomes "?"
            text = (response.text or "").encode("utf-8", "replace").decode("utf-8")
            message: dict[str, Any] = {"role": "tool", "content": text}
            if call.tool_call_id is not None:
                message["tool_call_id"] = call.tool_call_id
            messages.append(message)
            if reward is not None:
                data.tool_rewards.append(reward)
        ids = data.trajectory.delta_ids(messages)
        if len(data.trajectory.response_ids) + len(ids) >= self.response_length:
            return AgentState.TERMINATED  # no room to answer the results: end before them, as verl does
        data.trajectory.append_messages(messages, ids)
        data.user_turns += 1
        return AgentState.GENERATING

    async def _call_tool(self, call: FunctionCall, data: AgentData) -> tuple[ToolResponse, float, dict]:
        data.tool_call_count += 1
        try:
            response, reward, metrics = await self._run_tool(call, data)
        except _CallFailed as failed:
            data.tool_error_count += 1
            return ToolResponse(text=str(failed)), 0.0, {}
        text = truncate_tool_text(response.text or "", self.max_tool_response_length, self.tool_response_truncate_side)
        return ToolResponse(text=text, image=response.image, video=response.video), reward, metrics

    async def _run_tool(self, call: FunctionCall, data: AgentData) -> tuple[ToolResponse, float, dict]:
        name = _clip(call.name)
        if call.error is not None:
            raise _CallFailed(f"Error: {call.error}")
        tool = self.tools.get(call.name)
        if tool is None:
            raise _CallFailed(f"Error: unknown function '{name}'. Available tools: {sorted(self.tools)}")
        try:
            args = loads(call.arguments)
        except ValueError as e:
            raise _CallFailed(f"Error: the arguments of '{name}' are not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise _CallFailed(f"Error: the arguments of '{name}' must be a JSON object")
        invocation = asyncio.ensure_future(self._invoke(tool, call.name, args, data))
        try:
            done, _ = await asyncio.wait({invocation}, timeout=self.tool_timeout_s)
        finally:
            if not invocation.done():  # past the limit, or this trajectory was cancelled
                invocation.cancel()  # a subprocess goes with it; a blocking call's thread is a daemon
        if not done:
            # the tool's own cleanup (killing its subprocess, release) before the trajectory goes on
            await asyncio.wait({invocation}, timeout=CANCEL_GRACE_S)
            logger.warning("tool %s did not finish within multi_turn.tool_timeout_s=%g s", name, self.tool_timeout_s)
            raise _CallFailed(f"Error: tool '{name}' did not finish within {self.tool_timeout_s:g} s")
        try:
            return invocation.result()
        except Exception as e:  # a tool's failure is the model's observation, never the rollout's crash
            logger.warning("tool %s raised %s: %s", name, type(e).__name__, e)
            raise _CallFailed(f"Error executing tool '{name}': {type(e).__name__}: {e}") from None

    @staticmethod
    async def _invoke(tool: Any, name: str, args: dict[str, Any], data: AgentData) -> tuple[ToolResponse, float, dict]:
        if isinstance(tool, FunctionTool):
            return normalize_function_tool_return(await tool.call(args))
        create_kwargs = (data.tools_kwargs.get(name) or {}).get("create_kwargs", {})
        instance_id, _ = await tool.create(create_kwargs=create_kwargs)
        try:
            response, reward, metrics = await tool.execute(instance_id, args, agent_data=data)
            if not isinstance(response, ToolResponse):
                raise TypeError(f"execute returned a {type(response).__name__}, not a ToolResponse")
            try:  # the tool's own verdict on its state: compute_score reads it as extra_info.rollout_reward_scores
                data.reward_scores[name] = float(await tool.calc_reward(instance_id, agent_data=data))
            except Exception as e:  # its result stands; the reward function sees no score for it
                logger.warning("tool %s calc_reward raised %s: %s", _clip(name), type(e).__name__, e)
            return response, reward, metrics
        finally:  # also when the call is cancelled at its time limit
            try:
                await tool.release(instance_id)
            except Exception as e:
                logger.warning("tool %s release raised %s: %s", _clip(name), type(e).__name__, e)

class _CallFailed(Exception):
    """A call that failed; its message is the tool message the model reads."""


def _clip(name: str, limit: int = 64) -> str:
    """A tool name as echoed to the model and the log: the model's own string, so possibly huge."""
    return name if len(name) <= limit else name[:limit] + "..."
