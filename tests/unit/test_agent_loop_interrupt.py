"""Partial rollout of agent-loop trajectories on the native engine's token server (issue 46 item 4): a weight sync
interrupts the turns in flight, the interrupted turns keep their tokens and resume on the new weights, and every
sampled token's log-prob is the one of the weights that sampled it (teacher-forced transformers forwards of the
whole trajectory under the old and the new weights)."""

import asyncio

import pytest
import torch
from helpers.agent_loop_case import (
    TURN_TOKENS,
    agent_config,
    base_params,
    cut_during_turn,
    model_turn_starts,
    rows,
    token_sources,
)
from helpers.chat_models import save_chat_model

from verl.experimental.agent_loop import AgentLoopRunner
from verl.tools.calculator import CalculatorTool

pytestmark = pytest.mark.unit

CUT_AFTER_DECODE_STEPS = 3  # into the second batched turn


def test_interrupted_turns_resume_on_new_weights_with_per_token_log_probs(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig

    old, new = (save_chat_model(str(tmp_path / name), seed=seed) for name, seed in (("a", 3), ("b", 4)))
    engine = NativeRollout(ModelConfig.from_pretrained(old), pad_token_id=0)
    engine.load_hf_checkpoint(old)
    tok = AutoTokenizer.from_pretrained(old)
    server = engine.token_server(base_params(), pad_token_id=0)
    server.interruptible = True

    # The weight sync arrives while the second engine call (every trajectory's second turn) decodes.
    cut_during_turn(engine, server, call=2, decode_steps=CUT_AFTER_DECODE_STEPS)
    runner = AgentLoopRunner(agent_config(), server, tok, tools=[CalculatorTool({"type": "native"}, None)])

    async def rollout_with_a_weight_sync():
        task = asyncio.ensure_future(runner.generate(rows(), {"temperature": 0.0, "max_tokens": TURN_TOKENS}))
        while server.parked < len(rows()):  # every trajectory waits for the sync
            assert not task.done(), "the trajectories ended without waiting for the weight sync"
            await asyncio.sleep(0.005)
        engine.load_hf_checkpoint(new)  # the sync: new weights in place
        server.resume_turns()
        return await task

    result = asyncio.run(rollout_with_a_weight_sync())
    assert server.interrupted == len(rows()) and server.calls == 4  # turn 2 ran in two segments

    hf_old, hf_new = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (old, new))
    for out in result.outputs:
        sources = token_sources(out.model_dump(), hf_old, hf_new)
        # Old weights up to the sync, new ones after: the switch falls inside the second model turn, after the
        # CUT_AFTER_DECODE_STEPS + 1 tokens sampled before it.
        kinds = [kind for _, kind in sources]
        switch = kinds.index("new")
        assert set(kinds[switch:]) == {"new"}
        at = sources[switch][0]
        assert at == model_turn_starts(out.response_mask)[1] + CUT_AFTER_DECODE_STEPS + 1
        assert out.response_mask[at - 1] == 1  # mid-turn: the interrupted turn goes on where it stopped
