"""verl's tool interfaces: @function_tool schemas from signature + docstring, verl's tool YAML loaded with
yaml.safe_load (bad YAML / class / schema -> one-line InputError), a YAML tool and a function tool from a module
path called by the tool_agent loop, and the AST calculator."""

import asyncio
import sys
from pathlib import Path
from typing import Literal

import pytest

from verl.errors import InputError
from verl.tools.calculator import CalculatorError, CalculatorTool, evaluate
from verl.tools.function_tool import build_schema, function_tool, normalize_function_tool_return
from verl.tools.schemas import ToolResponse
from verl.tools.tool_registry import load_all_tools
from verl.tools.utils.tool_registry import load_all_tools as load_all_tools_old_path

pytestmark = pytest.mark.unit


def lookup(city: str, unit: Literal["c", "f"] = "c", days: int | None = None, tags: list[str] = ()) -> str:
    """Get the weather forecast.

    Args:
        city: The city name,
            e.g. Paris.
        unit (str): Temperature unit.
        days: How many days ahead.
        tags: Extra tags.

    Returns:
        The forecast.
    """
    return f"{city}:{unit}"


def test_function_tool_schema_from_signature_and_docstring():
    fn = build_schema(lookup).function
    assert fn.name == "lookup" and fn.description == "Get the weather forecast."
    props = {k: v.model_dump(exclude_none=True) for k, v in fn.parameters.properties.items()}
    assert props == {"city": {"type": "string", "description": "The city name, e.g. Paris."},
                     "unit": {"type": "string", "enum": ["c", "f"], "description": "Temperature unit."},
                     "days": {"type": ["integer", "null"], "description": "How many days ahead."},
                     "tags": {"type": "array", "items": {"type": "string"}, "description": "Extra tags."}}
    assert fn.parameters.required == ["city"]

    def undocumented(x: int) -> int:
        """Adds.

        Args:
            y: not x.
        """

    def untyped(x):
        """Adds.

        Args:
            x: a number.
        """

    def bare(x: int) -> int:
        return x

    # verl's wording (its tests match these phrases), as one InputError line
    with pytest.raises(InputError, match="the docstring has no description for the argument 'x'"):
        function_tool(undocumented)
    with pytest.raises(InputError, match="argument 'x' is missing a type hint"):
        function_tool(untyped)
    with pytest.raises(InputError, match="because it has no docstring"):
        function_tool(bare)
    with pytest.raises(TypeError, match=r"return tuple must have length 1, 2, or 3 \(got length 4"):
        normalize_function_tool_return(("a", 1, {}, 4))
    assert normalize_function_tool_return(("a", 1, {"m": 2})) == (ToolResponse(text="a"), 1.0, {"m": 2})
    assert normalize_function_tool_return({"k": 1})[0].text == '{"k": 1}'


def test_calculator_is_exact_and_never_evals():
    assert evaluate("(123456789 * 987654321) - 1") == 121932631112635268
    assert evaluate("-(2 ** 10) // 3 % 7") == (-(2 ** 10) // 3) % 7
    for bad, msg in [("__import__('os').system('true')", "unsupported syntax: Call"), ("x + 1", "Name"),
                     ("9 ** 9 ** 9", "too large"), ("1 / 0", "division by zero"), ("(1", "syntax error"),
                     ("[1, 2]", "List")]:
        with pytest.raises(CalculatorError, match=msg):
            evaluate(bad)
    tool = CalculatorTool({"type": "native"}, None)
    assert tool.name == "calculator"
    resp, reward, metrics = asyncio.run(tool.execute("i", {"expression": "7 / 2"}))
    assert (resp.text, metrics["error"]) == ("3.5", 0)
    assert asyncio.run(tool.execute("i", {"expression": 5}))[0].text.startswith("Error")


TOOLS_YAML = """
tools:
  - class_name: verl.tools.calculator.CalculatorTool
    config:
      type: native
  - class_name: {module}.Counter
    config:
      type: native
      start: 10
    tool_schema:
      type: function
      function:
        name: counter
        description: Count up.
        parameters:
          type: object
          properties:
            step: {{type: integer, description: by how much}}
          required: [step]
"""

FUNCTION_TOOLS = '''
from verl.tools.function_tool import function_tool


@function_tool
def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: What to shout.
    """
    return text.upper() + "!"
'''


def write_tools(tmp_path: Path):
    module = tmp_path / "my_tools_mod.py"
    module.write_text(
        "from verl.tools.base_tool import BaseTool\nfrom verl.tools.schemas import ToolResponse\n\n\n"
        "class Counter(BaseTool):\n"
        "    async def create(self, instance_id=None, create_kwargs=None, **kw):\n"
        "        iid, r = await super().create(instance_id)\n"
        "        self.value = self.config['start'] + (create_kwargs or {}).get('offset', 0)\n"
        "        return iid, r\n\n"
        "    async def execute(self, instance_id, parameters, **kw):\n"
        "        self.value += parameters['step']\n"
        "        return ToolResponse(text=str(self.value)), 1.0, {}\n")
    sys.path.insert(0, str(tmp_path))
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(TOOLS_YAML.format(module="my_tools_mod"))
    fn_path = tmp_path / "fn_tools.py"
    fn_path.write_text(FUNCTION_TOOLS)
    return cfg, fn_path


def test_yaml_and_function_tools_load_and_run_in_the_loop(tmp_path):
    from test_agent_loop import CHATML, ScriptedServerManager, call, char_tokenizer, make_config

    cfg, fn_path = write_tools(tmp_path)
    try:
        tools = load_all_tools(str(cfg), str(fn_path))
        assert [t.name for t in tools] == ["calculator", "counter", "shout"]
        assert [t.name for t in load_all_tools_old_path(str(cfg), None)] == ["calculator", "counter"]
        from verl.experimental.agent_loop import AgentLoopRunner

        tok = char_tokenizer(CHATML)
        server = ScriptedServerManager(tok, [call("counter", step=5) + "<|im_end|>", call("shout", text="hey") +
                                             "<|im_end|>", "fine<|im_end|>"])
        config = make_config(response_length=2000)
        config["actor_rollout_ref"]["rollout"]["multi_turn"].update(tool_config_path=str(cfg),
                                                                   function_tool_path=str(fn_path))
        runner = AgentLoopRunner(config, server, tok)
        row = {"raw_prompt": [{"role": "user", "content": "go"}], "agent_name": "tool_agent",
               "extra_info": {"tools_kwargs": {"counter": {"create_kwargs": {"offset": 100}}}}}
        out = runner.generate_sync([row], {}).outputs[0]
        text = tok.decode(out.response_ids, skip_special_tokens=False)
        assert "<tool_response>\n115\n</tool_response>" in text and "<tool_response>\nHEY!\n</tool_response>" in text
        assert out.extra_fields["tool_rewards"] == [1.0, 0.0]
        # the tool schemas reach the prompt's template (tools=...) unchanged
        prompt = tok.decode(out.prompt_ids, skip_special_tokens=False)
        assert server.calls[0][1] == out.prompt_ids and prompt.endswith("<|im_start|>assistant\n")
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize("text, match", [
    ("tools: [\n  - class_name: x\n", "not valid YAML"),
    ("tools:\n  - class_name: no_such_mod.Tool\n    config: {type: native}\n", "cannot import no_such_mod"),
    ("tools:\n  - class_name: verl.tools.calculator.Nope\n    config: {type: native}\n", "has no Nope"),
    ("tools:\n  - class_name: verl.tools.schemas.ToolResponse\n    config: {type: native}\n", "not a verl.tools"),
    ("tools:\n  - class_name: verl.tools.calculator.CalculatorTool\n    config: {type: native}\n"
     "    tool_schema: {type: function, function: {name: c}}\n", "tool_schema does not parse: function.description"),
    ("tools:\n  - class_name: verl.tools.calculator.CalculatorTool\n    config: {type: mcp}\n", "not supported"),
    ("nope: 1\n", "expected a mapping with a 'tools' list"),
    ("tools:\n  - class_name: verl.tools.calculator.CalculatorTool\n  - class_name: "
     "verl.tools.calculator.CalculatorTool\n", r"tool name\(s\) \['calculator'\] declared twice"),
])
def test_bad_tool_yaml_is_one_line_input_error(tmp_path, text, match):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=match) as info:
        load_all_tools(str(path), None)
    assert "\n" not in str(info.value)


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("tools: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_all_tools(str(path), None)
    with pytest.raises(FileNotFoundError, match="function_tool_path does not exist") as info:  # verl's type
        load_all_tools(None, str(tmp_path / "missing.py"))
    assert isinstance(info.value, InputError)  # and ours: exit code 2
    with pytest.raises(ModuleNotFoundError, match="cannot import no_such_mod") as info:  # verl's type, ours too
        path.write_text("tools:\n  - class_name: no_such_mod.Tool\n    config: {type: native}\n")
        load_all_tools(str(path), None)
    assert isinstance(info.value, InputError)


def test_function_tools_named_like_yaml_tools_are_all_named_in_one_line(tmp_path, caplog):
    """verl's rule and wording: every function tool whose name a tool_config_path tool has, sorted, in one
    error; a function_tool_path without any @function_tool is a warning and no tools."""
    from verl.tools.function_tool import FUNCTION_TOOL_REGISTRY

    yaml_path = tmp_path / "t.yaml"
    yaml_path.write_text("tools:\n  - class_name: verl.tools.calculator.CalculatorTool\n    config: {type: native}\n"
                         "    tool_schema: {type: function, function: {name: search, description: s}}\n"
                         "  - class_name: verl.tools.calculator.CalculatorTool\n    config: {type: native}\n")
    tools_py = tmp_path / "clash_tools.py"
    tools_py.write_text("from verl.tools.function_tool import function_tool\n\n"
                        + "".join(f"@function_tool\ndef {n}(q: str) -> str:\n    \"\"\"Look.\n\n    Args:\n"
                                  f"        q: what.\n    \"\"\"\n    return q\n\n\n"
                                  for n in ("search", "calculator", "fine")))
    try:
        with pytest.raises(InputError, match=r"function tool name\(s\) \['calculator', 'search'\] collide with "
                                             r"tools already declared in"):
            load_all_tools(str(yaml_path), str(tools_py))
    finally:
        for name in ("search", "calculator", "fine"):
            FUNCTION_TOOL_REGISTRY.pop(name, None)
    empty = tmp_path / "no_tools.py"
    empty.write_text("def helper():\n    return 1\n")
    with caplog.at_level("WARNING"):
        assert load_all_tools(None, str(empty)) == []
    assert "no @function_tool decorators found" in caplog.text


def test_schema_keywords_the_models_do_not_name_are_kept():
    """minimum / maximum / pattern / additionalProperties / an array's item schema reach the chat template as the
    caller wrote them (pydantic dropped them before); a property without a type is still refused."""
    from verl.tools.schemas import OpenAIFunctionToolSchema

    raw = {"type": "function", "function": {"name": "read", "description": "Read lines.", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["path"], "properties": {
            "path": {"type": "string", "description": "File.", "pattern": "^/"},
            "limit": {"type": "integer", "description": "Lines.", "minimum": 1, "maximum": 128},
            "edits": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["line"],
                                                                "properties": {"line": {"type": "integer"}}}}}}}}
    assert OpenAIFunctionToolSchema.model_validate(raw).model_dump(exclude_unset=True, exclude_none=True) == raw
    with pytest.raises(ValueError):
        OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
            "name": "x", "description": "d", "parameters": {"properties": {"p": {"description": "no type"}}}}})


def test_verls_module_paths_are_modules():
    """verl's tests reach the registry as ``verl.tools.function_tool._LOADED_FUNCTION_TOOL_PATHS`` through
    ``from verl.tools import function_tool``, and the older ``verl.tools.utils.function_tool`` path."""
    import verl.tools.utils.function_tool as legacy
    from verl.tools import function_tool as module

    assert isinstance(module._LOADED_FUNCTION_TOOL_PATHS, dict)
    assert legacy.FUNCTION_TOOL_REGISTRY is module.FUNCTION_TOOL_REGISTRY
