"""Hostile model output never ends a job (issue 56): tool-call parsing and the tool_agent loop fuzzed with random
and adversarial turns (JSON nested past the stack, integers past Python's digit limit, non-JSON or non-object
arguments under a template that iterates ``arguments|items``, lone surrogates, unknown tools, ids that are not
strings, many calls in one turn). Each bad call is a failed call counted in ``tool_call_errors``, never an
exception out of the loop. Also: a tool past ``multi_turn.tool_timeout_s`` is a tool error whose thread does not
hold the process, and the runner's concurrency limit works across ``asyncio.run`` calls."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_agent_loop import CHATML, LLAMA3, QWEN3, calculator, call, char_tokenizer, make_config, make_loop, sleeper

from verl.experimental.agent_loop import AgentLoopRunner
from verl.experimental.agent_loop.scripted import ScriptedServerManager
from verl.experimental.agent_loop.tool_parser import ToolParser, loads
from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import FunctionTool, build_schema
from verl.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionParsedSchema, OpenAIFunctionToolSchema

pytestmark = pytest.mark.unit
HERE = os.path.dirname(os.path.abspath(__file__))

# Hermes-2-Pro / Qwen3-Coder style: the arguments rendered key by key
ITEMS = CHATML.replace(
    "{{ '<tool_call>\n' + (tc.function | tojson) + '\n</tool_call>' }}",
    "{{ '<tool_call>\n' + tc.function.name }}{% for k, v in tc.function.arguments|items %}"
    "{{ ' ' + k + '=' + (v | tojson) }}{% endfor %}{{ '\n</tool_call>' }}")
TEMPLATES = {"chatml": CHATML, "qwen3": QWEN3, "llama3": LLAMA3, "items": ITEMS}
TOKENIZERS = {name: char_tokenizer(t, eos="<|eot_id|>" if name == "llama3" else "<|im_end|>")
              for name, t in TEMPLATES.items()}
MAX_PARALLEL = 3


def echo(text: str = "", n: int = 0) -> str:
    """Say the arguments back.

    Args:
        text: Anything.
        n: A number.
    """
    return f"{text} {n}"  # as given: a lone surrogate comes back


def tools():
    return [calculator(), FunctionTool("echo", echo, build_schema(echo))]


def raw_call(body: str) -> str:
    return "<tool_call>\n" + body + "\n</tool_call>"


ADVERSARIAL_CALLS = [
    raw_call("[" * 3000 + "]" * 3000),                                           # past the stack
    raw_call('{"name": "echo", "arguments": {"x": ' + "[" * 3000 + "]" * 3000 + "}}"),
    raw_call('{"name": "calculator", "arguments": {"expression": ' + "9" * 5000 + "}}"),  # > 4300 digits
    raw_call('{"name": "echo", "arguments": "print(1)"}'),                       # a string, not JSON
    raw_call('{"name": "echo", "arguments": "[1, 2]"}'),                         # JSON, not an object
    raw_call('{"name": "echo", "arguments": "' + "[" * 3000 + '"}'),             # double-encoded, too deep
    raw_call('{"name": "echo", "arguments": "' + "9" * 5000 + '"}'),             # double-encoded huge number
    raw_call('{"name": "echo", "arguments": {"text": "\\ud800\\udfff\\udcff"}}'),  # lone surrogates, echoed
    raw_call('{"name": "\\ud800", "arguments": {}}'),                             # a surrogate name (unknown)
    raw_call('{"name": "echo", "arguments": {"n": 1e999}}'),                     # inf
    raw_call('{"name": "echo", "arguments": {"n": -1e999, "text": NaN}}'),
    raw_call('{"name": "echo", "arguments": {}, "id": 5}'),                      # an id that is not a string
    raw_call('{"name": "echo", "arguments": {}, "id": {"a": [1]}}'),
    raw_call('{"name": "' + "x" * 20000 + '", "arguments": {}}'),                 # a huge unknown name
    raw_call('{"name": "echo", "arguments": {"text": 1, "zz": 2}}'),             # wrong types, unknown key
    raw_call('{"name": 7, "arguments": {}}'),
    raw_call("null"),
    raw_call('{"name": "echo", "arguments": {"text": "\u00e9\ufffd"}}'),
    call("echo", text="fine", n=3),
    call("calculator", expression="2**10"),
    call("nope", a=1),
    "<tool_call>{\"name\": \"echo\"",                                             # unclosed
    "</tool_call>",                                                               # stray closing tag
    bytes(range(128, 256)).decode("utf-8", "replace"),                            # invalid UTF-8, decoded
]

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)  # what JSON's "\\ud800" escapes yield
turn_text = st.lists(st.one_of(st.sampled_from(ADVERSARIAL_CALLS), st.text(max_size=40)), max_size=8).map("".join)


def expected_errors(parser, text: str, tool_names: set[str]) -> tuple[int, int]:
    """(calls, failed calls) the loop must count for one turn: parsed with an error, an unknown tool, arguments
    that are not a JSON object, a key ``echo`` has no parameter for (the call raises TypeError), or beyond
    max_parallel_calls (not run). The loop's own parse is the oracle's."""
    _, calls = parser.parse_text(text)
    failed = max(0, len(calls) - MAX_PARALLEL)
    for c in calls[:MAX_PARALLEL]:
        try:
            args = loads(c.arguments)
        except ValueError:
            args = None
        ok = (c.error is None and c.name in tool_names and isinstance(args, dict)
              and (c.name != "echo" or set(args) <= {"text", "n"}))
        failed += not ok
    return len(calls), failed


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(text=turn_text, template=st.sampled_from(sorted(TEMPLATES)))
def test_hostile_turns_are_failed_calls_never_exceptions(text, template):
    tok = TOKENIZERS[template]
    end = "<|eot_id|>" if template == "llama3" else "<|im_end|>"
    text = text.replace(end, "")  # one model turn: its stop token only at its end
    server = ScriptedServerManager(tok, [text + end, "done" + end])
    loop = make_loop(tok, server, tools(), response_length=100000, max_parallel_calls=MAX_PARALLEL)
    model_text = tok.decode(tok.encode(text + end, add_special_tokens=False), skip_special_tokens=False)
    n_calls, n_failed = expected_errors(loop.tool_parser, model_text, set(loop.tools))

    out = asyncio.run(loop.run({}, raw_prompt=[{"role": "user", "content": "go"}]))

    assert out.extra_fields["tool_call_counts"] == n_calls
    assert out.extra_fields["tool_call_errors"] == n_failed
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    assert out.num_turns == (4 if min(n_calls, MAX_PARALLEL) else 2)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(text=st.one_of(turn_text, st.text(st.one_of(st.characters(), SURROGATES), max_size=200)),
       fmt=st.sampled_from(["hermes", "gpt-oss"]))
def test_parsers_never_raise(text, fmt):
    content, calls = ToolParser.get_tool_parser(fmt, TOKENIZERS["chatml"]).parse_text(text)
    assert isinstance(content, str)
    for c in calls:
        assert isinstance(c.name, str) and isinstance(c.arguments, str)
        assert c.tool_call_id is None or isinstance(c.tool_call_id, str)
        parsed, failed = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
            OpenAIFunctionParsedSchema(name=c.name, arguments=c.arguments))
        assert isinstance(parsed.arguments, dict) and (failed or parsed.arguments == json.loads(c.arguments))


@pytest.mark.parametrize("body, why", [("[" * 3000 + "]" * 3000, "nested too deeply"),
                                      ('{"name": "f", "arguments": {"x": ' + "1" * 5000 + "}}", "4300 digits")])
def test_unreadable_json_is_a_failed_call(body, why):
    _, calls = ToolParser.get_tool_parser("hermes", TOKENIZERS["chatml"]).parse_text(raw_call(body))
    assert len(calls) == 1 and "not valid JSON" in calls[0].error and why in calls[0].error


def test_non_json_arguments_render_under_a_template_that_iterates_items():
    tok = TOKENIZERS["items"]
    script = [raw_call('{"name": "echo", "arguments": "print(1)"}') + "<|im_end|>", "done<|im_end|>"]
    out = asyncio.run(make_loop(tok, ScriptedServerManager(tok, script), tools()).run(
        {}, raw_prompt=[{"role": "user", "content": "go"}]))
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    assert "Error: the arguments of 'echo' are not valid JSON" in text and text.endswith("done<|im_end|>")
    assert (out.extra_fields["tool_call_counts"], out.extra_fields["tool_call_errors"]) == (1, 1)


def test_ten_calls_in_one_turn_run_the_first_and_count_the_rest_as_failed():
    tok = TOKENIZERS["chatml"]
    script = ["".join(call("echo", text=str(i)) for i in range(10)) + "<|im_end|>", "done<|im_end|>"]
    out = asyncio.run(make_loop(tok, ScriptedServerManager(tok, script), tools(), response_length=3000).run(
        {}, raw_prompt=[{"role": "user", "content": "go"}]))
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    assert text.count("<tool_response>") == 1 and "<tool_response>\n0 0\n" in text  # max_parallel_calls=1, as verl
    assert (out.extra_fields["tool_call_counts"], out.extra_fields["tool_call_errors"]) == (10, 9)


class Hung(BaseTool):
    """Never answers; counts its instances' releases."""

    released = 0

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.Event().wait()

    async def release(self, instance_id, **kwargs):
        type(self).released += 1


def test_a_tool_past_tool_timeout_s_is_a_tool_error_and_is_released():
    tok = TOKENIZERS["chatml"]
    hung = Hung({}, OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "hang", "description": "never answers"}}))
    script = [call("hang") + "<|im_end|>", call("echo", text="after") + "<|im_end|>", "done<|im_end|>"]
    loop = make_loop(tok, ScriptedServerManager(tok, script), [hung, *tools()], tool_timeout_s=0.3)

    async def run():  # the guard only turns a hang (no time limit) into a failure
        return await asyncio.wait_for(loop.run({}, raw_prompt=[{"role": "user", "content": "go"}]), 120)

    out = asyncio.run(run())
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    assert "Error: tool 'hang' did not finish within 0.3 s" in text and "after 0" in text
    assert (out.extra_fields["tool_call_counts"], out.extra_fields["tool_call_errors"]) == (2, 1)
    assert Hung.released == 1


BLOCKED_FOREVER = textwrap.dedent("""
    import asyncio, sys, threading
    sys.path.insert(0, {here!r})
    from test_agent_loop import call, char_tokenizer, make_loop, CHATML
    from verl.experimental.agent_loop.scripted import ScriptedServerManager
    from verl.tools.function_tool import FunctionTool, build_schema

    def block(x: int = 0) -> str:
        '''Blocks forever.

        Args:
            x: Unused.
        '''
        threading.Event().wait()

    tok = char_tokenizer(CHATML)
    server = ScriptedServerManager(tok, [call("block") + "<|im_end|>", "done<|im_end|>"])
    loop = make_loop(tok, server, [FunctionTool("block", block, build_schema(block))], tool_timeout_s=0.3)
    out = asyncio.run(loop.run({{}}, raw_prompt=[{{"role": "user", "content": "go"}}]))
    print("errors", out.extra_fields["tool_call_errors"], flush=True)
""")


def test_a_blocking_function_tool_past_its_limit_holds_neither_the_run_nor_the_exit():
    # asyncio.to_thread's executor thread is joined by asyncio.run and at exit: the child would never end
    proc = subprocess.run([sys.executable, "-c", BLOCKED_FOREVER.format(here=HERE)], capture_output=True,
                          text=True, timeout=120, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "errors 1"


def test_runner_concurrency_limit_across_event_loops():
    tok = TOKENIZERS["chatml"]
    tool = sleeper()
    server = ScriptedServerManager(tok, lambda prompt: [call("sleep", n=1) + "<|im_end|>", "ok<|im_end|>"])
    runner = AgentLoopRunner(make_config(), server, tok, tools=[tool], max_concurrency=2)
    rows = [{"raw_prompt": [{"role": "user", "content": f"q{i}"}], "agent_name": "tool_agent"} for i in range(5)]
    for _ in range(2):  # each a new asyncio.run, as the sync trainer's generations; contended (5 rows, 2 slots)
        batch = runner.generate_sync(rows, {})
        assert [o.num_turns for o in batch.outputs] == [4] * 5
    assert tool.peak == 2
