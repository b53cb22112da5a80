"""verl's stateful tool contract: one instance per trajectory (``create``), calls (``execute``), a reward from the
tool's state (``calc_reward``), and ``release``. Subclasses override what they need."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """Base of the tools that ``tool_config_path`` YAML declares: ``cls(config=..., tool_schema=...)``."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__} has no tool schema: give tool_schema or override "
                             "get_openai_tool_schema")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Start this tool's state for one trajectory; returns (instance_id, a response shown at creation)."""
        return (instance_id if instance_id is not None else uuid4().hex), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run one call: (response, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None
