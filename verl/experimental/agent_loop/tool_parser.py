"""Tool calls out of the model's tokens (verl's ``ToolParser`` registry, ``multi_turn.format``).

``hermes`` (verl's default; Qwen2.5/Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
``gpt-oss`` (OpenAI harmony): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``.

A call that cannot be read (bad JSON, no name, an unclosed tag) is returned as a ``FunctionCall`` carrying
``error``: the agent loop answers it with a tool message saying what was wrong instead of dropping it silently
(the model learns nothing from a call that just vanishes). The model's text is hostile input: no text makes a
parser raise (JSON nested past the interpreter's stack, an integer past Python's digit limit, an ``id`` that is
not a string are failed calls), and the hermes scan is linear in the text (a regex over thousands of unclosed
tags is quadratic and holds the event loop that every trajectory of the replica shares).
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from pydantic import BaseModel


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as the model wrote them (JSON text)."""
    tool_call_id: str | None = None
    error: str | None = None
    """Why the call could not be parsed, for the tool message; None for a well-formed call."""


def loads(text: str) -> Any:
    """``json.loads`` of the model's text with every way it fails as a ``ValueError`` of a short message: bad
    JSON, an integer past Python's 4300-digit limit, nesting deeper than the interpreter's stack."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at char {e.pos}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as e:
        raise ValueError(str(e).split(":")[0]) from None


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
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse_text(self, text: str) -> tuple[str, list[FunctionCall]]:
        text = _strip_special(text, self.tokenizer)
        calls, kept, pos = [], [], 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            end = text.find(self.CLOSE, start + len(self.OPEN))
            if end < 0:
                break
            calls.append(self._one(text[start + len(self.OPEN):end]))
            kept.append(text[pos:start])
            pos = end + len(self.CLOSE)
        content = "".join(kept) + text[pos:]
        # an opening tag with no closing tag after it: the model stopped (or was cut) inside a call
        last_close = content.rfind(self.CLOSE)
        unclosed = content.find(self.OPEN, last_close + 1 if last_close >= 0 else 0)
        if unclosed >= 0:
            calls.append(FunctionCall(name="", arguments=content[unclosed + len(self.OPEN):].strip(),
                                      error="the tool call has no closing </tool_call>"))
            content = content[:unclosed]
        return content.strip(), calls

    @staticmethod
    def _one(body: str) -> FunctionCall:
        body = body.strip()
        try:
            call = loads(body)
        except ValueError as e:
            return FunctionCall(name="", arguments=body, error=f"the tool call is not valid JSON ({e}); expected "
                                                               '{"name": ..., "arguments": {...}}')
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return FunctionCall(name="", arguments=body, error='the tool call needs a "name" string')
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models double-encode the arguments
            raw = arguments
        else:
            try:
                raw = json.dumps(arguments, ensure_ascii=False)
            except RecursionError:  # parsed near the stack's limit, deeper from here
                return FunctionCall(name=call["name"], arguments=body, error="the arguments are nested too deeply")
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        return FunctionCall(name=call["name"], arguments=raw, tool_call_id=call_id)


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
