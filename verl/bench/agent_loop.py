"""Throughput of the concurrent agent loop (issue 46, item 7): trajectories/s of ``AgentLoopRunner`` running a
batch at once against the same trajectories run one at a time, with a tool that sleeps ``tool_sleep_s`` per call,
on the scripted server manager (no model: this measures the loop's overlap of tool waits, not an engine)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from verl.experimental.agent_loop import AgentLoopRunner
from verl.experimental.agent_loop.scripted import ScriptedServerManager
from verl.tools.function_tool import FunctionTool, build_schema


def bench_agent_loop(tokenizer, n_trajectories: int = 32, calls_per_trajectory: int = 2, tool_sleep_s: float = 0.05,
                     eos: str | None = None) -> dict[str, Any]:
    """``{"concurrent_traj_per_s", "sequential_traj_per_s", "speedup", ...}`` for hermes tool calls rendered by
    ``tokenizer``'s chat template."""
    eos = eos if eos is not None else (tokenizer.eos_token or "")
    in_flight = {"now": 0, "peak": 0}  # tool calls running at once: the overlap the concurrent loop is for

    async def wait(seconds: float) -> str:
        """Sleep like a slow tool.

        Args:
            seconds: How long.
        """
        in_flight["now"] += 1
        in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
        try:
            await asyncio.sleep(seconds)
        finally:
            in_flight["now"] -= 1
        return "ok"

    tool = FunctionTool("wait", wait, build_schema(wait, "wait"), is_async=True)
    call = "<tool_call>\n" + json.dumps({"name": "wait", "arguments": {"seconds": tool_sleep_s}}) + "\n</tool_call>"
    script = [call + eos] * calls_per_trajectory + ["done" + eos]
    config = {"actor_rollout_ref": {"rollout": {
        "prompt_length": 4096, "response_length": 8192, "agent": {"default_agent_loop": "tool_agent"},
        "multi_turn": {"format": "hermes", "max_parallel_calls": 1, "max_tool_response_length": 256}}}}
    rows = [{"raw_prompt": [{"role": "user", "content": f"task {i}"}]} for i in range(n_trajectories)]

    def runner() -> AgentLoopRunner:
        return AgentLoopRunner(config, ScriptedServerManager(tokenizer, script), tokenizer, tools=[tool])

    t0 = time.perf_counter()
    batch = runner().generate_sync(rows, {})
    concurrent_s = time.perf_counter() - t0
    peak_concurrent, in_flight["peak"] = in_flight["peak"], 0
    one = runner()
    t0 = time.perf_counter()
    for row in rows:
        one.generate_sync([row], {})
    sequential_s = time.perf_counter() - t0
    assert all(o.extra_fields["tool_call_counts"] == calls_per_trajectory for o in batch.outputs)
    return {"n_trajectories": n_trajectories, "calls_per_trajectory": calls_per_trajectory,
            "tool_sleep_s": tool_sleep_s, "concurrent_s": concurrent_s, "sequential_s": sequential_s,
            "concurrent_traj_per_s": n_trajectories / concurrent_s,
            "sequential_traj_per_s": n_trajectories / sequential_s, "speedup": sequential_s / concurrent_s,
            "peak_tool_calls_concurrent": peak_concurrent, "peak_tool_calls_sequential": in_flight["peak"]}
