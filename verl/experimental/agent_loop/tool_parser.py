"""Tool calls out of the model's tokens (verl's ``ToolParser`` registry, ``multi_turn.format``).

``hermes`` (verl's default; Qwen2.5/Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
``gpt-oss`` (OpenAI harmony): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``.

A call that cannot be read (bad JSON, no name, an unclosed tag) is returned as a ``FunctionCall`` carrying
``error``: the agent loop answers it with a tool message saying what was wrong instead of dropping it silently
(the model learns nothing from a call that just vanishes).
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from pydantic import BaseModel


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as the model wrote them (JSON text)."""
    tool_call_id: str | None = None
    error: str | None = None
    """Why the call could not be parsed, for the tool message; None for a well-formed call."""


class ToolParser:
    _registry: ClassVar[dict[str, type[ToolParser]]] = {}

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that must end generation so the parser can run (none when the model emits EOS itself)."""
        return []

    def decode(self, response_ids: list[int]) -> str:
        return self.tokenizer.decode(response_ids, skip_special_tokens=False)

    def parse_text(self, text: str) -> tuple[str, list[FunctionCall]]:
        raise NotImplementedError

    async def extract_tool_calls(self, responses_ids: list[int], tools=None) -> tuple[str, list[FunctionCall]]:
        """(content without the calls, calls) of one model turn."""
        return self.parse_text(self.decode(responses_ids))

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer) -> ToolParser:
        if name not in cls._registry:
            from verl.errors import InputError
            raise InputError(f"multi_turn.format '{name}': unknown tool-call format (known: {sorted(cls._registry)})")
        return cls._registry[name](tokenizer)

    @classmethod
    def register(cls, name: str):
        def decorator(subclass: type[ToolParser]) -> type[ToolParser]:
            cls._registry[name] = subclass
            return subclass

        return decorator


def _strip_special(text: str, tokenizer) -> str:
    for tok in getattr(tokenizer, "all_special_tokens", []) or []:
        if tok:
            text = text.replace(tok, "")
    return text


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    _call = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _unclosed = re.compile(r"<tool_call>(?!.*</tool_call>)(.*)$", re.DOTALL)

    def parse_text(self, text: str) -> tuple[str, list[FunctionCall]]:
        text = _strip_special(text, self.tokenizer)
        calls = [self._one(m.group(1)) for m in self._call.finditer(text)]
        content = self._call.sub("", text)
        unclosed = self._unclosed.search(content)
        if unclosed:
            calls.append(FunctionCall(name="", arguments=unclosed.group(1).strip(),
                                      error="the tool call has no closing </tool_call>"))
            content = content[:unclosed.start()]
        return content.strip(), calls

    @staticmethod
    def _one(body: str) -> FunctionCall:
        body = body.strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return FunctionCall(name="", arguments=body, error=f"the tool call is not valid JSON ({e.msg} at "
                                                               f"char {e.pos}); expected "
                                                               '{"name": ..., "arguments": {...}}')
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return FunctionCall(name="", arguments=body, error='the tool call needs a "name" string')
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models double-encode the arguments
            raw = arguments
        else:
            raw = json.dumps(arguments, ensure_ascii=False)
        return FunctionCall(name=call["name"], arguments=raw, tool_call_id=call.get("id"))


@ToolParser.register("gpt-oss")
class GptOssToolParser(ToolParser):
    # the recipient sits in the channel header (``<|channel|>commentary to=functions.f``) or the role header
    # (``<|start|>assistant to=functions.f<|channel|>commentary``)
    _call = re.compile(
        r"(?:<\|start\|>assistant)?(?:\s*to=functions\.(?P<n1>[\w.\-]+))?<\|channel\|>(?P<channel>[^<]*?)"
        r"(?:\s*to=functions\.(?P<n2>[\w.\-]+))?\s*(?:<\|constrain\|>\s*json)?<\|message\|>(?P<args>.*?)<\|call\|>",
        re.DOTALL)
    _analysis = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>.*?<\|end\|>", re.DOTALL)

    @property
    def stop_token_ids(self) -> list[int]:
        tid = self.tokenizer.convert_tokens_to_ids("<|call|>")
        unk = getattr(self.tokenizer, "unk_token_id", None)
        return [tid] if isinstance(tid, int) and tid >= 0 and tid != unk else []

    def parse_text(self, text: str) -> tuple[str, list[FunctionCall]]:
        text = self._analysis.sub("", text)  # reasoning may mention calls that were never made
        calls, content = [], text
        for m in self._call.finditer(text):
            name = m.group("n1") or m.group("n2")
            if not name:
                continue
            calls.append(FunctionCall(name=name, arguments=m.group("args").strip()))
            content = content.replace(m.group(0), "")
        content = re.sub(r"<\|[a-z_]+\|>", "", content)
        return content.strip(), calls
