"""verl's tool interfaces at verl's import paths: ``BaseTool`` (stateful), ``@function_tool`` (stateless,
``verl.tools.function_tool.function_tool``), ``schemas``, ``tool_registry.load_all_tools``; built-in tools:
``calculator.CalculatorTool`` and ``code_interpreter.CodeInterpreterTool`` (model code run in ``sandbox``).

``verl.tools.function_tool`` stays the module, as in verl (its tests reach the module's registry through it): the
decorator is not re-exported here under the module's name."""

from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import FunctionTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool", "FunctionTool", "OpenAIFunctionToolSchema", "ToolResponse"]
