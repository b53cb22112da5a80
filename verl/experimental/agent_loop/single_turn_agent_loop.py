"""``single_turn_agent``: the prompt's chat template, one generation, no tools."""

from __future__ import annotations

import time
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
    token_output,
)
from verl.experimental.agent_loop.chat_template import encode, render


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        prompt_ids = self.cap_prompt(encode(self.tokenizer, render(self.tokenizer, messages, add_generation_prompt=True,
                                                                   **self.apply_chat_template_kwargs)))
        params = {**sampling_params, "max_tokens": min(int(sampling_params.get("max_tokens", self.response_length)),
                                                       self.response_length)}
        start = time.perf_counter()
        out = token_output(await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids,
                                                              sampling_params=params))
        ids = out.token_ids[:self.response_length]
        logprobs = out.log_probs[:self.response_length] if out.log_probs is not None else None
        metrics = AgentLoopMetrics(generate_sequences=time.perf_counter() - start,
                                   num_preempted=out.num_preempted if out.num_preempted is not None else -1)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids, response_mask=[1] * len(ids),
                               response_logprobs=logprobs, num_turns=2, metrics=metrics,
                               extra_fields={**out.extra_fields, "turn_scores": [], "tool_rewards": [],
                                             "reward_scores": {}, "tool_call_counts": 0})
