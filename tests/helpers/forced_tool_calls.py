"""A tool-call format for tests with random models (imported through ``actor_rollout_ref.model.external_lib``):
every model turn is one sampled token, read as a call of the calculator. A random tiny model never writes a
well-formed ``<tool_call>``; this puts the real engine's tokens, the tool's answers and the chat-template deltas
through the whole multi-turn path (mask, log-probs, trainer) all the same."""

import json

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

EXPRESSION = "6*7"


@ToolParser.register("test_every_turn_calls")
class EveryTurnCallsCalculator(ToolParser):
    @property
    def stop_token_ids(self) -> list[int]:
        return list(range(1024))  # any token ends the turn: one token per assistant turn

    def parse_text(self, text: str) -> tuple[str, list[FunctionCall]]:
        return text, [FunctionCall(name="calculator", arguments=json.dumps({"expression": EXPRESSION}))]


@ToolParser.register("test_random_length_calls")
class RandomLengthCallsCalculator(EveryTurnCallsCalculator):
    """As above, but a turn ends only on one of the first 40 of the model's 320 ids (~1 sampled token in 8), so
    turns have random lengths and trajectories finish at different times: the asynchronous trainer's phases cut
    some of them mid-turn."""

    @property
    def stop_token_ids(self) -> list[int]:
        return list(range(40))
