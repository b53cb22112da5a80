"""One multi-turn agent-loop batch that both rollout engines run (tests/sglang/test_sglang_agent_loop.py): the
tool agent over a token server with the calculator and ``helpers.turn_tool_calls`` (every turn a call), greedy,
several tokens a turn. Imported in .venv (the native engine) and in .venv-sglang (agent_loop_driver.py)."""

import helpers.turn_tool_calls  # noqa: F401  (registers the format)

PROMPTS = ["6*7?", "Compute 6*7.", "9-2?"]
TURN_TOKENS = 8        # each turn's max_tokens
ASSISTANT_TURNS = 3
RESPONSE_LENGTH = 72   # tiny model context 128: prompt ~25 + 3 turns x 8 + 2 tool deltas x ~23
EOS = 2                # helpers.chat_models' <|im_end|>


def base_params():
    from verl.engine.rollout.base import SamplingParams

    return SamplingParams(do_sample=False, response_length=RESPONSE_LENGTH, eos_token_id=(EOS,))


def agent_config() -> dict:
    return {"actor_rollout_ref": {"rollout": {
        "prompt_length": 40, "response_length": RESPONSE_LENGTH,
        "multi_turn": {"format": "test_turn_calls", "max_assistant_turns": ASSISTANT_TURNS, "max_parallel_calls": 1,
                       "max_tool_response_length": 64, "tool_response_truncate_side": "middle"},
        "agent": {"default_agent_loop": "tool_agent"}}}}


def rows() -> list[dict]:
    return [{"raw_prompt": [{"role": "user", "content": p}]} for p in PROMPTS]


def run_batch(server, tokenizer) -> dict:
    """The batch through ``server`` (an engine's token server), run on the server's loop: per trajectory its
    prompt, response ids, mask, log-probs and turns, plus the server's counters."""
    return server.run(run_batch_async(server, tokenizer))


async def run_batch_async(server, tokenizer, turn_tokens: int = TURN_TOKENS) -> dict:
    from verl.experimental.agent_loop import AgentLoopRunner
    from verl.tools.calculator import CalculatorTool

    runner = AgentLoopRunner(agent_config(), server, tokenizer, tools=[CalculatorTool({"type": "native"}, None)])
    result = await runner.generate(rows(), {"temperature": 0.0, "max_tokens": turn_tokens, "logprobs": True})
    return {"trajectories": [{"prompt_ids": o.prompt_ids, "response_ids": o.response_ids,
                              "response_mask": o.response_mask, "response_logprobs": o.response_logprobs,
                              "num_turns": o.num_turns} for o in result.outputs],
            "requests": server.requests, "prompt_tokens": getattr(server, "prompt_tokens", 0),
            "cached_tokens": getattr(server, "cached_tokens", 0)}


def model_turn_starts(mask: list[int]) -> list[int]:
    """Where each model turn (a run of mask 1) starts in a response."""
    return [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]


def token_sources(trajectory: dict, hf_old, hf_new, atol: float = 1e-4) -> list[tuple[int, str]]:
    """(response index, "old" or "new") for every sampled token of a greedy trajectory: the weights (HF models,
    teacher-forced over the whole trajectory) whose argmax it is and whose log-prob it carries; asserts one does."""
    import torch

    ids = trajectory["prompt_ids"] + trajectory["response_ids"]
    with torch.no_grad():
        lps = [hf(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1) for hf in (hf_old, hf_new)]
    p = len(trajectory["prompt_ids"])
    sources = []
    for i, (token, logprob, mask) in enumerate(zip(trajectory["response_ids"], trajectory["response_logprobs"],
                                                   trajectory["response_mask"], strict=True)):
        if not mask:
            assert logprob == 0.0
            continue
        row = p + i - 1
        matches = [name for name, lp in zip(("old", "new"), lps, strict=True)
                   if abs(float(lp[row, token]) - logprob) < atol and int(lp[row].argmax()) == token]
        assert matches, f"token {i}: its log-prob is neither weights' greedy choice"
        sources.append((i, "old" if "old" in matches else "new"))
    return sources


def cut_during_turn(engine, server, call: int, decode_steps: int) -> None:
    """Patch ``engine``'s forward so that ``server.interrupt()`` is raised from the engine thread after
    ``decode_steps`` decode steps of its engine call number ``call`` (a weight sync arriving mid-turn)."""
    forward, steps = engine.model.forward, []

    def counting_forward(input_ids, *args, **kwargs):
        if server.calls == call and input_ids.shape[1] == 1:
            steps.append(1)
            if len(steps) == decode_steps:
                server.interrupt()
        return forward(input_ids, *args, **kwargs)

    engine.model.forward = counting_forward
