"""Tools from verl's YAML (``tool_config_path``) and from a file of ``@function_tool`` functions
(``function_tool_path``), as verl's ``verl.tools.tool_registry``.

The YAML, read with ``yaml.safe_load`` (YAML 1.2 floats, :mod:`verl.utils.yaml_io`)::

    tools:
      - class_name: verl.tools.calculator.CalculatorTool   # a BaseTool subclass, by module path
        config: {type: native}                              # passed to the class as ``config``
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}  # optional

A file that does not parse, a class that does not import, a schema that does not validate: ``InputError`` with
one line naming the file and the entry, before any rollout starts.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import ValidationError

from verl.errors import InputError, InputModuleNotFoundError
from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import FunctionTool, load_function_tools_from_path
from verl.tools.schemas import OpenAIFunctionToolSchema
from verl.utils.yaml_io import read_yaml_file

# Tools that moved: a tool YAML written against the former path still loads.
FORMER_CLASS_NAMES = {"verl.tools.sandbox.CodeInterpreterTool": "verl.tools.code_interpreter.CodeInterpreterTool"}


def get_tool_class(cls_name: str) -> type:
    """The class at ``package.module.ClassName``."""
    cls_name = FORMER_CLASS_NAMES.get(str(cls_name), cls_name)
    module_name, _, class_name = str(cls_name).rpartition(".")
    if not module_name:
        raise InputError(f"tool class_name '{cls_name}' is not a module path (package.module.ClassName)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise InputModuleNotFoundError(f"tool class_name '{cls_name}': cannot import {module_name}: {e}") from None
    except ImportError as e:
        raise InputError(f"tool class_name '{cls_name}': cannot import {module_name}: {e}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise InputError(f"tool class_name '{cls_name}': {module_name} has no {class_name}")
    return cls


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return f"{loc}: {first.get('msg')}" if loc else str(first.get("msg"))


def initialize_tools_from_config(tools_config_file: str) -> list[BaseTool]:
    """Instantiate every ``BaseTool`` the YAML declares."""
    data = read_yaml_file(tools_config_file, "tool_config_path")
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise InputError(f"tool_config_path {tools_config_file}: expected a mapping with a 'tools' list")
    tools = []
    for i, entry in enumerate(data["tools"]):
        where = f"tool_config_path {tools_config_file}: tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise InputError(f"{where}: expected a mapping with class_name, config and optional tool_schema")
        config: dict[str, Any] = entry.get("config") or {}
        if not isinstance(config, dict):
            raise InputError(f"{where}: config must be a mapping, got {type(config).__name__}")
        if str(config.get("type", "native")) != "native":
            raise InputError(f"{where}: config.type '{config.get('type')}' is not supported (only 'native')")
        schema = None
        if entry.get("tool_schema") is not None:
            try:
                schema = OpenAIFunctionToolSchema.model_validate(entry["tool_schema"])
            except ValidationError as e:
                raise InputError(f"{where}: tool_schema does not parse: {_one_line(e)}") from None
        cls = get_tool_class(entry["class_name"])
        if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
            raise InputError(f"{where}: {entry['class_name']} is not a verl.tools.base_tool.BaseTool subclass")
        try:
            tools.append(cls(config=config, tool_schema=schema))
        except InputError:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise InputError(f"{where}: {entry['class_name']}: {e}") from None
    return tools


def load_all_tools(tool_config_path: str | None, function_tool_path: str | None) -> list[BaseTool | FunctionTool]:
    """The YAML's tools then the function tools; function tools named like a YAML tool are refused, all of them
    in one line (two YAML tools of one name too)."""
    native = initialize_tools_from_config(tool_config_path) if tool_config_path else []
    functions = load_function_tools_from_path(function_tool_path) if function_tool_path else []
    names = [t.name for t in native]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InputError(f"tool_config_path '{tool_config_path}': tool name(s) {twice} declared twice; each tool "
                         "name must be unique")
    declared = set(names)
    collisions = sorted(t.name for t in functions if t.name in declared)
    if collisions:
        raise InputError(f"function tool name(s) {collisions} collide with tools already declared in "
                         f"'{tool_config_path}'; each tool name must be unique across tool_config_path and "
                         "function_tool_path: rename one of them")
    return [*native, *functions]
