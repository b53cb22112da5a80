"""Multi-turn agent loops on the native rollout engine (issue 46): the engine's token server batches the turns of
concurrent trajectories, and each trajectory's sampled tokens carry the engine's log-probs (equal to a
teacher-forced forward of the whole trajectory) while the tool tokens between turns are the chat template's
deltas with mask 0."""

import asyncio

import pytest
import torch
from helpers.chat_models import save_chat_model

from verl.engine.rollout.base import RolloutInputError, SamplingParams
from verl.experimental.agent_loop import AgentLoopRunner, pad_outputs
from verl.experimental.agent_loop.chat_template import Trajectory
from verl.tools.calculator import CalculatorTool

pytestmark = pytest.mark.unit

PROMPTS = ["What is 6*7? Use the calculator.", "Compute 6*7.", "6*7=?", "Please: 6 times 7"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig

    path = save_chat_model(str(tmp_path_factory.mktemp("chat")), seed=3)
    engine = NativeRollout(ModelConfig.from_pretrained(path), pad_token_id=0)
    engine.load_hf_checkpoint(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return engine, hf, AutoTokenizer.from_pretrained(path)


def config(fmt="test_every_turn_calls", max_assistant_turns=3, response_length=80):
    return {"actor_rollout_ref": {"rollout": {
        "prompt_length": 48, "response_length": response_length,
        "multi_turn": {"format": fmt, "max_assistant_turns": max_assistant_turns, "max_parallel_calls": 1,
                       "max_tool_response_length": 256, "tool_response_truncate_side": "middle"},
        "agent": {"default_agent_loop": "tool_agent"}}}}


def run(engine, tok, params, rows, cfg=None):
    import helpers.forced_tool_calls  # noqa: F401  (registers the format)

    server = engine.token_server(params, pad_token_id=0)
    runner = AgentLoopRunner(cfg or config(), server, tok, tools=[CalculatorTool({"type": "native"}, None)])
    return server, asyncio.run(runner.generate(rows, {"temperature": params.temperature, "logprobs": True}))


def test_tool_turns_masked_and_log_probs_equal_a_forward_of_the_trajectory(chat_model):
    engine, hf, tok = chat_model
    params = SamplingParams(temperature=0.7, response_length=80, eos_token_id=(2,), seed=11)
    rows = [{"raw_prompt": [{"role": "user", "content": p}]} for p in PROMPTS]
    server, result = run(engine, tok, params, rows)

    # The turns of the 4 trajectories ran batched: 3 turns each in 3 engine calls.
    assert (server.requests, server.calls) == (12, 3)
    assert result.metrics["num_turns/min"] == result.metrics["num_turns/max"] == 6  # user + 3 x (model, tool) - 1 + 1
    assert result.metrics["tool_call_counts/mean"] == 2
    for row, out in zip(rows, result.outputs, strict=True):
        # The trajectory rebuilt from its messages: prompt, then each model token (mask 1) and the template's
        # delta of the calculator's answer (mask 0).
        traj = Trajectory(tok, row["raw_prompt"])
        assert out.prompt_ids == traj.prompt_ids
        model_at = [i for i, m in enumerate(out.response_mask) if m]
        assert len(model_at) == 3 and model_at[0] == 0
        for turn, at in enumerate(model_at):
            traj.append_model_tokens([out.response_ids[at]], [out.response_logprobs[at]])
            if turn < 2:
                traj.messages.append({"role": "assistant", "content": tok.decode([out.response_ids[at]])})
                traj.append_messages([{"role": "tool", "content": "42"}])
        assert traj.response_ids == out.response_ids and traj.response_mask == out.response_mask
        answer = tok.encode("<|im_start|>tool\n42<|im_end|>", add_special_tokens=False)
        assert str(answer)[1:-1] in str(out.response_ids)
        assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if not m)

        # Every sampled token's log-prob is log_softmax(logits / T) of a forward over the whole trajectory.
        ids = torch.tensor([out.prompt_ids + out.response_ids])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0].float() / params.temperature
        p = len(out.prompt_ids)
        expected = logits[p - 1:-1].log_softmax(-1).gather(-1, torch.tensor(out.response_ids)[:, None])[:, 0]
        got = torch.tensor(out.response_logprobs)
        mask = torch.tensor(out.response_mask).bool()
        torch.testing.assert_close(got[mask], expected[mask], atol=2e-5, rtol=1e-5)

    # The trainer's tensors: mask and log-probs where the tokens are.
    fields = pad_outputs(result.outputs, 48, 80, pad_token_id=0)
    for i, out in enumerate(result.outputs):
        n = len(out.response_ids)
        assert fields["response_mask"][i, :n].tolist() == out.response_mask
        assert fields["response_mask"][i, n:].sum() == 0 and fields["attention_mask"][i, 48:48 + n].all()
        assert fields["rollout_log_probs"][i, :n].tolist() == pytest.approx(out.response_logprobs)


def test_turn_budget_context_and_unknown_params(chat_model):
    engine, _, tok = chat_model
    params = SamplingParams(do_sample=False, response_length=40, eos_token_id=(2,))
    server = engine.token_server(params, pad_token_id=0)
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)

    async def turns():
        return await asyncio.gather(
            server.generate(request_id="a", prompt_ids=prompt, sampling_params={"max_tokens": 5}),
            server.generate(request_id="b", prompt_ids=prompt, sampling_params={"max_tokens": 9}),
            # 128-token context: only 2 tokens left for this one
            server.generate(request_id="c", prompt_ids=[5] * 126, sampling_params={"max_tokens": 9}),
            server.generate(request_id="d", prompt_ids=[5] * 128, sampling_params={"max_tokens": 9}))

    a, b, c, d = asyncio.run(turns())
    assert server.calls == 1
    assert len(a["token_ids"]) <= 5 and len(b["token_ids"]) <= 9 and len(c["token_ids"]) <= 2
    assert b["token_ids"][:len(a["token_ids"])] == a["token_ids"]  # greedy: the same start
    assert d == {"token_ids": [], "log_probs": [], "stop_reason": "length"}
    assert len(a["log_probs"]) == len(a["token_ids"])
    with pytest.raises(RolloutInputError, match="repetition_penalty"):
        server.request_params({"repetition_penalty": 1.2})
    with pytest.raises(RolloutInputError, match="frequency_penalty"):
        server.request_params({"frequency_penalty": 0.5})
