"""``@function_tool``: a typed, documented Python function as a stateless tool (verl's ``verl.tools.function_tool``).

The OpenAI schema comes from the signature (types, defaults -> ``required``) and the Google-style docstring (summary
-> description, ``Args:`` -> each parameter's description). A function without a docstring, a type hint or an
``Args:`` line for a parameter is refused at decoration time with one line (``InputError``, in verl's wording).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl.errors import InputError, InputFileNotFoundError
from verl.tools.concurrency import run_in_daemon_thread
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.logging_utils import get_logger

logger = get_logger(__name__)

FUNCTION_TOOL_REGISTRY: dict[str, FunctionTool] = {}
_LOADED_FUNCTION_TOOL_PATHS: dict[str, list[FunctionTool]] = {}  # verl's name: its tests clear it


@dataclass
class FunctionTool:
    """A registered function: ``name``, ``tool_schema`` and the callable (sync ones run on a daemon thread, so one
    that hangs past the tool time limit holds neither the generation nor the process's exit)."""

    name: str
    fn: Callable[..., Any]
    tool_schema: OpenAIFunctionToolSchema
    is_async: bool = False

    async def call(self, parameters: dict[str, Any]) -> Any:
        if self.is_async:
            return await self.fn(**parameters)
        return await run_in_daemon_thread(self.fn, **parameters)


_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array",
           type(None): "null"}


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"type": _SIMPLE.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        kinds = []
        for a in args:
            t = _json_type(a, where)["type"]
            kinds.extend(t if isinstance(t, list) else [t])
        return {"type": kinds}
    if origin in (list, tuple, set):
        out: dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            out["items"] = _json_type(args[0], where)
        return out
    if origin is dict:
        return {"type": "object"}
    raise InputError(f"@function_tool {where}: type {hint!r} has no JSON-schema equivalent")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(summary, {arg: description}) of a Google-style docstring: the summary is the text before the first
    section header; in ``Args:`` a line at the first entry's indentation starts an argument, a deeper one
    continues it."""
    summary, args = [], {}
    section, arg_indent, current = None, None, None
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        if re.fullmatch(r"[A-Z][A-Za-z ]*:", stripped):
            section, arg_indent, current = stripped[:-1], None, None
            continue
        if section is None:
            if stripped:
                summary.append(stripped)
            continue
        if section not in ("Args", "Arguments", "Parameters") or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        m = re.match(r"^(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", stripped)
        if m and (arg_indent is None or indent <= arg_indent):
            arg_indent, current = indent, m.group(1)
            args[current] = m.group(3).strip()
        elif current is not None:
            args[current] = (args[current] + " " + stripped).strip()
    return " ".join(summary), args


def build_schema(fn: Callable, name: str | None = None) -> OpenAIFunctionToolSchema:
    """The OpenAI tool schema of ``fn`` from its signature and docstring."""
    where = f"'{name or fn.__name__}' ({fn.__module__}.{fn.__qualname__})"
    if not fn.__doc__ or not fn.__doc__.strip():
        raise InputError(f"@function_tool {where}: cannot generate a JSON schema because it has no docstring "
                         "(a summary and an Args: block)")
    summary, arg_docs = _parse_docstring(fn.__doc__)
    if not summary:
        raise InputError(f"@function_tool {where}: the docstring has no summary line")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # unresolvable forward reference
        raise InputError(f"@function_tool {where}: cannot resolve type hints: {e}") from None
    properties, required = {}, []
    for pname, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise InputError(f"@function_tool {where}: variadic parameter '{pname}' cannot be a tool argument")
        if pname not in hints:
            raise InputError(f"@function_tool {where}: argument '{pname}' is missing a type hint")
        if pname not in arg_docs:
            raise InputError(f"@function_tool {where}: the docstring has no description for the argument "
                             f"'{pname}' (under Args:)")
        prop = _json_type(hints[pname], where)
        prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if p.default is p.empty:
            required.append(pname)
    return OpenAIFunctionToolSchema.model_validate({
        "type": "function",
        "function": {"name": name or fn.__name__, "description": summary,
                     "parameters": {"type": "object", "properties": properties, "required": required}}})


def function_tool(name: str | Callable | None = None, *, schema: OpenAIFunctionToolSchema | dict | None = None):
    """Register a function as a tool: ``@function_tool``, ``@function_tool("name")`` or ``schema=`` to skip
    inference. Returns the function unchanged (the tool is in ``FUNCTION_TOOL_REGISTRY``)."""

    def make(tool_name: str | None):
        def decorate(fn: Callable) -> Callable:
            final = tool_name or fn.__name__
            if isinstance(schema, OpenAIFunctionToolSchema):
                built = schema
            elif isinstance(schema, dict):
                built = OpenAIFunctionToolSchema.model_validate(schema)
            else:
                built = build_schema(fn, final)
            existing = FUNCTION_TOOL_REGISTRY.get(final)
            if existing is not None and existing.fn is not fn and (
                    existing.fn.__module__, existing.fn.__qualname__) != (fn.__module__, fn.__qualname__):
                raise InputError(f"@function_tool '{final}' is already registered to "
                                 f"{existing.fn.__module__}.{existing.fn.__qualname__}")
            FUNCTION_TOOL_REGISTRY[final] = FunctionTool(final, fn, built, inspect.iscoroutinefunction(fn))
            return fn

        return decorate

    if callable(name):
        return make(None)(name)
    return make(name)


def get_function_tool(name: str) -> FunctionTool:
    if name not in FUNCTION_TOOL_REGISTRY:
        raise KeyError(f"function tool '{name}' is not registered (is its file under function_tool_path?)")
    return FUNCTION_TOOL_REGISTRY[name]


def load_function_tools_from_path(path: str) -> list[FunctionTool]:
    """Run the Python file at ``path`` once and return the tools its ``@function_tool`` registered (none: a
    warning and ``[]``, as verl does)."""
    abs_path = os.path.abspath(path)
    if not os.path.isfile(abs_path):
        raise InputFileNotFoundError(f"function_tool_path does not exist: {path}")
    if abs_path in _LOADED_FUNCTION_TOOL_PATHS:
        return _LOADED_FUNCTION_TOOL_PATHS[abs_path]
    before = dict(FUNCTION_TOOL_REGISTRY)
    module_name = "_verl_function_tools_" + re.sub(r"\W", "_", abs_path)
    spec = importlib.util.spec_from_file_location(module_name, abs_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except InputError:
        raise
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise InputError(f"function_tool_path {path}: {type(e).__name__}: {e}") from None
    tools = [t for n, t in FUNCTION_TOOL_REGISTRY.items() if before.get(n) is not t]
    if not tools:
        logger.warning("function_tool_path '%s' loaded but no @function_tool decorators found; did you forget to "
                       "apply the decorator?", path)
    _LOADED_FUNCTION_TOOL_PATHS[abs_path] = tools
    return tools


def normalize_function_tool_return(ret: Any) -> tuple[ToolResponse, float, dict]:
    """A function's return as (ToolResponse, reward, metrics): ToolResponse / str / dict / other as text, or a
    tuple (response[, reward[, metrics]])."""
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(f"@function_tool return tuple must have length 1, 2, or 3 (got length {len(ret)}: "
                            f"{ret!r}): (response,), (response, reward) or (response, reward, metrics)")
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return _as_response(ret[0]), reward, metrics
    return _as_response(ret), 0.0, {}


def _as_response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=str(value))
