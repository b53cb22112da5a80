"""verl's agent loops on a scripted model: token-exact trajectories (the model's tokens as sampled with their
log-probs, tool messages as chat-template deltas with mask 0) on ChatML, a Qwen3-style <think> template and a
Llama-3-style template; the tool_agent state machine (limits, parallel calls, truncation, errors as tool
messages); tool-call parsers; the concurrent runner and its verl metric names."""

import asyncio
import json
import string
import time

import pytest

from verl.errors import InputError
from verl.experimental.agent_loop import AgentLoopBase, AgentLoopOutput, AgentLoopRunner, pad_outputs, register
from verl.experimental.agent_loop.chat_template import Trajectory, encode, render, turn_closing_text
from verl.experimental.agent_loop.scripted import ScriptedServerManager
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop, truncate_tool_text
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.calculator import CalculatorTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

pytestmark = pytest.mark.unit
CHATML = (  # SmolLM2's template (the real checkpoint's), plus hermes-style tools as Qwen2.5 renders them
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if message.tool_calls is defined %}{% for tc in message.tool_calls %}"
    "{{ '<tool_call>\n' + (tc.function | tojson) + '\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3's rule: an assistant turn keeps its <think> only after the last real user query; earlier ones are
# rendered without it.
QWEN3 = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{% elif m.role == 'assistant' %}"
    "{% set content = m.content %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% else %}{% set reasoning = '' %}{% endif %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% if loop.index0 > ns.last_query and reasoning %}{{ '<think>\n' + reasoning + '\n</think>\n\n' }}{% endif %}"
    "{{ content }}"
    "{% if m.tool_calls is defined %}{% for tc in m.tool_calls %}"
    "{{ '<tool_call>\n' + (tc.function | tojson) + '\n</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{% for m in messages %}"
    "{% set role = 'ipython' if m.role == 'tool' else m.role %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{% if m.tool_calls is defined %}{% for tc in m.tool_calls %}"
    "{{ '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' + (tc.function.arguments | tojson) + '}' }}"
    "{% endfor %}{% else %}{{ m.content | trim }}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|call|>", "<|end|>",
           "<|constrain|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def char_tokenizer(chat_template: str, eos: str = "<|im_end|>"):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for tok in SPECIAL + ADDED:
        vocab[tok] = len(vocab)
    for ch in string.printable + "\u2063":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, eos_token=eos,
                                   pad_token="<|endoftext|>", unk_token="<unk>")


def make_config(response_length=400, **multi_turn):
    mt = {"format": "hermes", "max_parallel_calls": 1, "max_tool_response_length": 256,
          "tool_response_truncate_side": "middle", **multi_turn}
    return {"actor_rollout_ref": {"rollout": {"prompt_length": 512, "response_length": response_length,
                                              "multi_turn": mt, "agent": {"default_agent_loop": "tool_agent"}}}}


def make_loop(tok, server, tools, **cfg):
    from verl.experimental.agent_loop import DictConfigWrap, ToolListWrap
    return ToolAgentLoop(trainer_config=DictConfigWrap(make_config(**cfg)), server_manager=server, tokenizer=tok,
                         processor=None, dataset_cls=None, data_config=DictConfigWrap({}), tools=ToolListWrap(tools))


def call(name, **args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def calculator():
    return CalculatorTool(config={"type": "native"}, tool_schema=None)


def check_alignment(out: AgentLoopOutput, server: ScriptedServerManager, tok):
    """Token by token: every mask-1 run is exactly one server answer (ids and log-probs, in order), every mask-0
    token has log-prob 0, and each generate call saw exactly the trajectory so far under one request id."""
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    runs, cur = [], None
    for i, m in enumerate(out.response_mask):
        if m == 1:
            if cur is None:
                cur = [i, i]
                runs.append(cur)
            cur[1] = i + 1
        else:
            cur = None
            assert out.response_logprobs[i] == 0.0
    assert len(runs) == len(server.calls)
    assert len({rid for rid, _, _ in server.calls}) == 1  # sticky: one request id for the whole trajectory
    for (start, end), (_, prompt, _) in zip(runs, server.calls, strict=True):
        assert prompt == out.prompt_ids + out.response_ids[:start]
        assert all(lp < 0 for lp in out.response_logprobs[start:end])
        assert sorted(out.response_logprobs[start:end], reverse=True) == out.response_logprobs[start:end]
    # log-probs are unique per sampled token: the mask-1 log-probs in order are exactly those the server handed out
    sampled = [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m]
    assert sampled == [-(k + 1) / 1000 for k in range(len(sampled))]
    return runs


def test_chatml_trajectory_is_the_template_of_its_messages_and_aligned():
    tok = char_tokenizer(CHATML)
    script = [call("calculator", expression="1234*5678") + "<|im_end|>", "It is 7006652.<|im_end|>"]
    server = ScriptedServerManager(tok, script)
    loop = make_loop(tok, server, [calculator()])
    messages = [{"role": "user", "content": "What is 1234*5678?"}]
    out = asyncio.run(loop.run({"temperature": 1.0}, raw_prompt=messages))
    runs = check_alignment(out, server, tok)
    assert len(runs) == 2 and out.num_turns == 4
    assert out.extra_fields["tool_call_counts"] == 1 and out.extra_fields["tool_call_errors"] == 0
    # mask-0 part: the separator the model did not write ("\n" after <|im_end|>) + the tool turn + the next prompt
    tool_part = tok.decode(out.response_ids[runs[0][1]:runs[1][0]], skip_special_tokens=False)
    assert tool_part == ("\n<|im_start|>user\n<tool_response>\n7006652\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    # where the template is stable the trajectory IS the template of its messages (closing "\n" aside)
    full = messages + [{"role": "assistant", "content": "",
                        "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                                          "arguments": {"expression": "1234*5678"}}}]},
                       {"role": "tool", "content": "7006652"}, {"role": "assistant", "content": "It is 7006652."}]
    assert encode(tok, render(tok, full, loop.tool_schemas)) == out.prompt_ids + out.response_ids + encode(tok, "\n")


def test_qwen3_think_tokens_are_trained_as_generated_never_re_rendered():
    tok = char_tokenizer(QWEN3)
    turn1 = ("<think>\nBig numbers: use the tool.\n</think>\n\n" + call("calculator", expression="99*99")
             + "<|im_end|>")
    turn2 = "<think>\nThe tool said 9801.\n</think>\n\n9801<|im_end|>"
    server = ScriptedServerManager(tok, [turn1, turn2])
    loop = make_loop(tok, server, [calculator()])
    out = asyncio.run(loop.run({}, raw_prompt=[{"role": "user", "content": "99*99?"}]))
    runs = check_alignment(out, server, tok)
    for (start, end), text in zip(runs, [turn1, turn2], strict=True):
        assert out.response_ids[start:end] == encode(tok, text)  # <think>...</think> kept, trained (mask 1)
    # a new user turn makes this template drop earlier reasoning: the history's rendering is no longer a prefix,
    # yet the trajectory only grows by the new turn's tokens
    traj = Trajectory(tok, [{"role": "user", "content": "q1"}])
    traj.append_model_tokens(encode(tok, "<think>\nr\n</think>\n\na1<|im_end|>"), None)
    traj.messages.append({"role": "assistant", "content": "<think>\nr\n</think>\n\na1"})
    before = list(traj.all_ids)
    added = traj.append_messages([{"role": "user", "content": "q2"}])
    assert traj.all_ids == before + added
    assert tok.decode(added, skip_special_tokens=False) == "\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n"
    rerender = render(tok, traj.messages, add_generation_prompt=True)
    assert "<think>" not in rerender and "<think>" in tok.decode(traj.all_ids, skip_special_tokens=False)
    assert traj.has_logprobs is False


def test_llama3_template_deltas_and_no_missing_separator():
    tok = char_tokenizer(LLAMA3, eos="<|eot_id|>")
    assert turn_closing_text(tok) == "<|eot_id|>"
    script = [call("calculator", expression="2**20") + "<|eot_id|>", "1048576<|eot_id|>"]
    server = ScriptedServerManager(tok, script)
    out = asyncio.run(make_loop(tok, server, [calculator()]).run({}, raw_prompt=[{"role": "user", "content": "2^20?"}]))
    runs = check_alignment(out, server, tok)
    tool_part = tok.decode(out.response_ids[runs[0][1]:runs[1][0]], skip_special_tokens=False)
    assert tool_part == ("<|start_header_id|>ipython<|end_header_id|>\n\n1048576<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert out.prompt_ids[:1] == encode(tok, "<|begin_of_text|>") and out.response_ids.count(out.prompt_ids[0]) == 0


class Boom(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("disk on fire")


def boom():
    return Boom({}, OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "boom", "description": "explodes"}}))


def test_unknown_tool_bad_json_and_raising_tool_become_tool_messages():
    tok = char_tokenizer(CHATML)
    script = [call("nope", x=1) + "<|im_end|>", "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {oops}\n"
              "</tool_call><|im_end|>", call("boom") + "<|im_end|>", call("calculator", expression="1/0") +
              "<|im_end|>", "done<|im_end|>"]
    server = ScriptedServerManager(tok, script)
    loop = make_loop(tok, server, [calculator(), boom()], response_length=1500)
    out = asyncio.run(loop.run({}, raw_prompt=[{"role": "user", "content": "go"}]))
    check_alignment(out, server, tok)
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    assert "Error: unknown function 'nope'. Available tools: ['boom', 'calculator']" in text
    assert "Error: the tool call is not valid JSON" in text
    assert "Error executing tool 'boom': RuntimeError: disk on fire" in text
    assert "Error: division by zero" in text
    assert out.num_turns == 10 and out.extra_fields["tool_call_errors"] == 3


class Sleeper(BaseTool):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.created, self.released, self.running, self.peak = 0, 0, 0, 0

    async def create(self, instance_id=None, **kwargs):
        self.created += 1
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id, parameters, **kwargs):
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0.2)
        self.running -= 1
        return ToolResponse(text="x" * int(parameters["n"])), 0.5, {}

    async def release(self, instance_id, **kwargs):
        self.released += 1


def sleeper():
    return Sleeper({}, OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "sleep", "description": "sleeps",
                                          "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}))


def test_parallel_calls_capped_concurrent_and_tool_text_truncated():
    tok = char_tokenizer(CHATML)
    tool = sleeper()
    script = [call("sleep", n=50) + call("sleep", n=3) + call("sleep", n=3) + "<|im_end|>", "ok<|im_end|>"]
    server = ScriptedServerManager(tok, script)
    loop = make_loop(tok, server, [tool], max_parallel_calls=2, max_tool_response_length=10,
                     tool_response_truncate_side="left")
    t0 = time.perf_counter()
    out = asyncio.run(loop.run({}, raw_prompt=[{"role": "user", "content": "go"}]))
    assert time.perf_counter() - t0 < 0.39  # two 0.2 s calls overlapped
    assert tool.peak == 2 and tool.created == tool.released == 2  # the third call is dropped (max_parallel_calls)
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    assert "(truncated)..." + "x" * 10 + "\n</tool_response>" in text and "x" * 11 not in text
    assert out.extra_fields["tool_rewards"] == [0.5, 0.5]
    assert truncate_tool_text("abcdefghij", 4, "right") == "abcd...(truncated)"
    assert truncate_tool_text("abcdefghij", 4, "middle") == "ab...(truncated)...ij"


def test_turn_limits_and_response_budget_end_the_trajectory():
    tok = char_tokenizer(CHATML)
    forever = [call("calculator", expression="1+1") + "<|im_end|>"] * 20
    server = ScriptedServerManager(tok, list(forever))
    out = asyncio.run(make_loop(tok, server, [calculator()], max_assistant_turns=3).run(
        {}, raw_prompt=[{"role": "user", "content": "go"}]))
    assert len(server.calls) == 3 and out.response_mask[-1] == 1
    server = ScriptedServerManager(tok, list(forever))
    out = asyncio.run(make_loop(tok, server, [calculator()], max_user_turns=1).run(
        {}, raw_prompt=[{"role": "user", "content": "go"}]))
    assert len(server.calls) == 2
    server = ScriptedServerManager(tok, list(forever))
    out = asyncio.run(make_loop(tok, server, [calculator()], response_length=150).run(
        {}, raw_prompt=[{"role": "user", "content": "go"}]))
    assert len(out.response_ids) <= 150 and len(out.response_mask) == len(out.response_ids)
    # each call was offered only the budget left
    for (_, prompt, params) in server.calls:
        assert params["max_tokens"] == 150 - (len(prompt) - len(out.prompt_ids))


def test_parsers_hermes_and_gpt_oss():
    tok = char_tokenizer(CHATML)
    hermes = ToolParser.get_tool_parser("hermes", tok)
    content, calls = hermes.parse_text("Let me see. " + call("f", a=1) + call("g") + "<tool_call>{\"name\"")
    assert content == "Let me see." and [c.name for c in calls] == ["f", "g", ""]
    assert json.loads(calls[0].arguments) == {"a": 1} and calls[2].error.startswith("the tool call has no closing")
    oss = ToolParser.get_tool_parser("gpt-oss", tok)
    text = ("<|channel|>analysis<|message|>maybe to=functions.evil <|constrain|>json<|message|>{}<|call|> no<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            "{\"city\": \"Paris\"}<|call|>")
    content, calls = oss.parse_text(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert oss.stop_token_ids == [tok.convert_tokens_to_ids("<|call|>")]
    with pytest.raises(InputError, match="unknown tool-call format"):
        ToolParser.get_tool_parser("nope", tok)


@register("echo_agent_for_test")
class EchoAgent(AgentLoopBase):
    def __init__(self, *args, greeting="hi", **kwargs):
        kwargs.pop("tools", None)
        super().__init__(*args, **kwargs)
        self.greeting = greeting

    async def run(self, sampling_params, **kwargs):
        ids = encode(self.tokenizer, self.greeting)
        return AgentLoopOutput(prompt_ids=[1], response_ids=ids, response_mask=[1] * len(ids), num_turns=2)


def test_runner_mixes_agents_concurrently_with_verl_metrics(tmp_path):
    tok = char_tokenizer(CHATML)

    def script(prompt_ids):
        text = tok.decode(prompt_ids, skip_special_tokens=False)
        if "single" in text:
            return ["plain answer<|im_end|>"]
        return [call("sleep", n=2) + "<|im_end|>", call("sleep", n=2) + "<|im_end|>", "done<|im_end|>"]

    server = ScriptedServerManager(tok, script)
    cfg_path = tmp_path / "agents.yaml"
    cfg_path.write_text(f"- name: echo2\n  _target_: {__name__}.EchoAgent\n  greeting: hello\n")
    config = make_config()
    config["actor_rollout_ref"]["rollout"]["agent"]["agent_loop_config_path"] = str(cfg_path)
    runner = AgentLoopRunner(config, server, tok, tools=[sleeper()])
    rows = [{"raw_prompt": [{"role": "user", "content": f"q{i}"}], "agent_name": "tool_agent"} for i in range(8)]
    rows += [{"raw_prompt": [{"role": "user", "content": "single"}], "agent_name": "single_turn_agent"},
             {"raw_prompt": [{"role": "user", "content": "x"}], "agent_name": "echo2"}]
    t0 = time.perf_counter()
    batch = runner.generate_sync(rows, {"temperature": 1.0})
    assert time.perf_counter() - t0 < 1.5  # 8 trajectories x 2 sleeping calls of 0.2 s overlap
    assert [o.num_turns for o in batch.outputs] == [6] * 8 + [2, 2]
    assert tok.decode(batch.outputs[9].response_ids) == "hello"
    m = batch.metrics
    assert (m["num_turns/min"], m["num_turns/max"]) == (2, 6) and m["num_turns/mean"] == pytest.approx(5.2)
    assert m["tool_call_counts/max"] == 2 and m["tool_call_counts/min"] == 0
    assert {"agent_loop/tool_calls/mean", "agent_loop/generate_sequences/max"} <= set(m)
    padded = pad_outputs(batch.outputs[:9], prompt_length=128, response_length=400,
                         pad_token_id=tok.pad_token_id)
    assert padded["responses"].shape == (9, 400) and padded["input_ids"].shape == (9, 528)
    o = batch.outputs[0]
    assert padded["response_mask"][0, :len(o.response_mask)].tolist() == o.response_mask
    assert padded["rollout_log_probs"][0, :len(o.response_ids)].tolist() == pytest.approx(o.response_logprobs)
    assert padded["attention_mask"][0].sum() == len(o.prompt_ids) + len(o.response_ids)
    with pytest.raises(InputError, match="agent_name 'nope' is not a registered agent loop"):
        runner.generate_sync([{"raw_prompt": rows[0]["raw_prompt"], "agent_name": "nope"}], {})


def test_bad_agent_loop_config_is_one_line_input_error(tmp_path):
    bad = tmp_path / "a.yaml"
    bad.write_text("- name: x\n  _target_: no.such.module.Loop\n")
    config = make_config()
    config["actor_rollout_ref"]["rollout"]["agent"]["agent_loop_config_path"] = str(bad)
    with pytest.raises(InputError, match="cannot import no.such.module.Loop"):
        AgentLoopRunner(config, None, char_tokenizer(CHATML), tools=[])
    config["actor_rollout_ref"]["rollout"]["agent"] = {"default_agent_loop": "missing_loop"}
    with pytest.raises(InputError, match="'missing_loop' is not a registered"):
        AgentLoopRunner(config, None, char_tokenizer(CHATML), tools=[])


def test_bench_concurrent_loop_overlaps_the_tool_calls_one_at_a_time_does_not():
    from verl.bench.agent_loop import bench_agent_loop

    # The figure (trajectories/s, its ratio) is the benchmark's to print; the test checks what makes it: the
    # concurrent loop overlaps the trajectories' tool calls, one at a time does not.
    result = bench_agent_loop(char_tokenizer(CHATML), n_trajectories=8, calls_per_trajectory=2, tool_sleep_s=0.05)
    assert result["sequential_s"] >= 8 * 2 * 0.05
    assert result["peak_tool_calls_concurrent"] == 8 and result["peak_tool_calls_sequential"] == 1, result
