"""Agent loops that live across training steps (verl.workers.agent_stream, ``rollout.multi_turn`` under
colocate_async): a phase's end cuts the turns in the engine, they wait while the weights change, and the next
phase resumes them on the new weights. Each finished trajectory reports the versions that sampled its tokens, and
every sampled token carries the log-prob of the weights that sampled it (teacher-forced transformers forwards of
the whole trajectory under the old and the new weights)."""

import time

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
from verl.workers.agent_stream import AgentStream

pytestmark = pytest.mark.unit

CUT_AFTER_DECODE_STEPS = 3  # into the second batched turn


def wait_for(predicate, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.005)


def test_a_phase_end_cuts_turns_that_resume_on_the_next_weights_with_their_versions(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig

    old, new = (save_chat_model(str(tmp_path / name), seed=seed) for name, seed in (("a", 3), ("b", 4)))
    engine = NativeRollout(ModelConfig.from_pretrained(old), pad_token_id=0)
    engine.load_hf_checkpoint(old)
    server = engine.token_server(base_params(), pad_token_id=0)
    runner = AgentLoopRunner(agent_config(), server, AutoTokenizer.from_pretrained(old),
                             tools=[CalculatorTool({"type": "native"}, None)])
    stream = AgentStream(runner, server, {"temperature": 0.0, "max_tokens": TURN_TOKENS})
    # The phase ends while the second engine call (every trajectory's second turn) decodes: the trainer's batch
    # became ready then (here: the engine thread raises the flag pause() raises, then the test pauses).
    cut_during_turn(engine, server, call=2, decode_steps=CUT_AFTER_DECODE_STEPS)
    try:
        groups = [{"uid": f"g{i}", "n": 1, "replica": 0, "row": row} for i, row in enumerate(rows())]
        stream.open(0, groups)
        wait_for(lambda: server.parked == len(rows()), "every trajectory held at the phase's end")
        assert stream.poll(0) == []  # nothing finished: the trainer would wait
        paused = stream.pause()
        assert paused["agent_loop/interrupted_turns"] == len(rows()) and paused["agent_loop/engine_calls"] == 2
        assert paused["agent_loop/in_flight"] == len(rows())

        engine.load_hf_checkpoint(new)  # the weight sync between phases
        stream.open(1, [])
        records = []
        wait_for(lambda: records.extend(stream.poll(0.05)) or len(records) == len(rows()), "the trajectories")
        assert stream.pause()["agent_loop/in_flight"] == 0
    finally:
        stream.close()

    hf_old, hf_new = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (old, new))
    assert sorted(r.uid for r in records) == [g["uid"] for g in groups]
    for record in records:
        assert record.error is None and record.num_turns == 6 and record.tool_calls == 2
        # turn 1 and turn 2's first segment on version 0; turn 2's rest and turn 3 on version 1
        assert record.versions == [0, 0, 1, 1]
        trajectory = {"prompt_ids": record.prompt_ids, "response_ids": record.response_ids,
                      "response_mask": record.response_mask, "response_logprobs": record.response_logprobs}
        kinds = [kind for _, kind in token_sources(trajectory, hf_old, hf_new)]
        switch = kinds.index("new")
        assert set(kinds[:switch]) == {"old"} and set(kinds[switch:]) == {"new"}
        at = token_sources(trajectory, hf_old, hf_new)[switch][0]
        assert at == model_turn_starts(record.response_mask)[1] + CUT_AFTER_DECODE_STEPS + 1
