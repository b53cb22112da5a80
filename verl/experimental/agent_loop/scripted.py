"""A server manager that plays a fixed script: the deterministic model of the agent loop's tests and benchmark.

Each call ``generate(request_id=, prompt_ids=, sampling_params=)`` returns the next turn of the script chosen for
that request (by a function of the first prompt it saw), tokenized, with a distinct log-prob per token so that
alignment errors show. It records every call (request id, prompt ids) so a test can check that each turn's
prompt is exactly the trajectory so far.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from verl.experimental.agent_loop.agent_loop import TokenOutput


class ScriptedServerManager:
    def __init__(self, tokenizer, script: list[str] | Callable[[list[int]], list[str]], delay_s: float = 0.0):
        self.tokenizer = tokenizer
        self.script = script
        self.delay_s = delay_s
        self.calls: list[tuple[str, list[int], dict[str, Any]]] = []
        self._turns: dict[str, list[str]] = {}
        self._next_logprob = 0

    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **_: Any) -> TokenOutput:
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        if request_id not in self._turns:
            turns = self.script(list(prompt_ids)) if callable(self.script) else self.script
            self._turns[request_id] = list(turns)
        remaining = self._turns[request_id]
        if not remaining:
            raise RuntimeError(f"scripted server: request {request_id} asked for more turns than the script has")
        text = remaining.pop(0)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        limit = sampling_params.get("max_tokens")
        if limit is not None:
            ids = ids[:int(limit)]
        logprobs = []
        for _ in ids:
            self._next_logprob += 1
            logprobs.append(-self._next_logprob / 1000.0)  # unique per token: a shifted mask shows
        return TokenOutput(token_ids=ids, log_probs=logprobs, stop_reason="completed")
