"""verl's tool interfaces at verl's import paths: ``BaseTool`` (stateful), ``@function_tool`` (stateless),
``schemas``, ``tool_registry.load_all_tools``; built-in tools: ``calculator.CalculatorTool`` and
``code_interpreter.CodeInterpreterTool`` (model code run in ``sandbox``)."""

from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import FunctionTool, function_tool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool", "FunctionTool", "OpenAIFunctionToolSchema", "ToolResponse", "function_tool"]
