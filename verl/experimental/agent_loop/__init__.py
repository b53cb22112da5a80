"""verl's agent loops: ``AgentLoopBase``, ``AgentLoopOutput``, ``register``; built-ins ``single_turn_agent`` and
``tool_agent``; ``AgentLoopRunner`` runs many trajectories concurrently over a server manager."""

from verl.experimental.agent_loop import single_turn_agent_loop, tool_agent_loop  # noqa: F401  (register built-ins)
from verl.experimental.agent_loop.agent_loop import (
                                                     AgentLoopBase,
                                                     AgentLoopMetrics,
                                                     AgentLoopOutput,
                                                     DictConfigWrap,
                                                     TokenOutput,
                                                     ToolListWrap,
                                                     register,
)
from verl.experimental.agent_loop.runner import AgentLoopBatch, AgentLoopRunner, batch_metrics, pad_outputs
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

__all__ = ["AgentLoopBase", "AgentLoopBatch", "AgentLoopMetrics", "AgentLoopOutput", "AgentLoopRunner",
           "DictConfigWrap", "SingleTurnAgentLoop", "TokenOutput", "ToolAgentLoop", "ToolListWrap", "batch_metrics",
           "pad_outputs", "register"]
