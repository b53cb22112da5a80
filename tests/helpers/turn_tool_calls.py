"""A tool-call format for tests with random models: every model turn, whatever its tokens (up to its stop token
or its ``max_tokens``), is read as one call of the calculator. Turns are several tokens long, so an engine's
reuse of a trajectory's prefix across turns (the model's tokens and the tool deltas) is exercised."""

import json

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

EXPRESSION = "6*7"


@ToolParser.register("test_turn_calls")
class TurnCallsCalculator(ToolParser):
    @property
    def stop_token_ids(self) -> list[int]:
        return []  # the tokenizer's eos and the turn's max_tokens end a turn

    def parse_text(self, text: str) -> tuple[str, list[FunctionCall]]:
        return text, [FunctionCall(name="calculator", arguments=json.dumps({"expression": EXPRESSION}))]
