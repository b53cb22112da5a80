"""verl's older import path of the tool registry: the same functions as :mod:`verl.tools.tool_registry`."""

from verl.tools.tool_registry import get_tool_class, initialize_tools_from_config, load_all_tools

__all__ = ["get_tool_class", "initialize_tools_from_config", "load_all_tools"]
