"""Runs under .venv-sglang/bin/python: ``python agent_loop_driver.py MODEL_DIR NEW_MODEL_DIR OUT.json``.

One SGLang engine (TP 1) on the checkpoint MODEL_DIR: the agent-loop batch of ``helpers.agent_loop_case`` through
its token server (OUT ``greedy``); then the batch again with a weight sync in the middle (OUT ``partial``): once
every trajectory's second turn is running, the turns are interrupted, NEW_MODEL_DIR's weights are pushed (the
trainer's route: each rollout rank's flat buffer) and the turns resume."""

import asyncio
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.agent_loop_case import base_params, run_batch, run_batch_async  # noqa: E402  (tests/, not a package)
from sglang_session import rank_buffers  # noqa: E402  (this directory)

SYNC_TURN_TOKENS = 16  # long enough a turn that the abort reaches it before it ends


def batch_with_a_weight_sync(server, tokenizer, push) -> dict:
    """The batch, its event loop stopped at the sync as a trainer's segment ends: the weights are pushed while the
    interrupted trajectories wait (parked) on the stopped loop, which then runs them to the end."""
    from helpers.agent_loop_case import rows

    task = None

    async def until_synced():
        nonlocal task
        task = asyncio.ensure_future(run_batch_async(server, tokenizer, SYNC_TURN_TOKENS))
        states = server._engine.tokenizer_manager.rid_to_state
        # every second turn in flight, i.e. known to SGLang (an abort of a rid it has not registered is dropped)
        while server.requests < 2 * len(rows()) or sum(rid in states for rid in server._running) < len(rows()):
            assert not task.done(), "the batch ended before its second turns"
            await asyncio.sleep(0.001)
        running = server.interrupt()
        while server.parked < len(rows()):
            await asyncio.sleep(0.005)
        return running

    running = server.run(until_synced())
    push()  # no request in flight: SGLang's update flushes its cache (the old weights' KV)

    async def resumed():
        server.resume_turns()
        return await task

    out = server.run(resumed())
    out["running_at_sync"] = running
    out["interrupted"] = server.interrupted
    return out


def stream_with_a_weight_sync(server, tokenizer, push_old, push_new) -> dict:
    """The batch as the asynchronous trainers run it (verl.workers.agent_stream.AgentStream, SGLang's loop on the
    stream's thread during a phase only): a phase on version 0 ends once every second turn is in flight; the
    weights change while the loop is parked; the next phase, on version 1, runs the trajectories to their end."""
    from helpers.agent_loop_case import agent_config, rows

    from verl.experimental.agent_loop import AgentLoopRunner
    from verl.tools.calculator import CalculatorTool
    from verl.workers.agent_stream import AgentStream

    push_old()  # the engine holds the first checkpoint's weights again (the partial batch pushed the second's)
    runner = AgentLoopRunner(agent_config(), server, tokenizer, tools=[CalculatorTool({"type": "native"}, None)])
    stream = AgentStream(runner, server, {"temperature": 0.0, "max_tokens": SYNC_TURN_TOKENS, "logprobs": True})
    states = server._engine.tokenizer_manager.rid_to_state
    try:
        stream.open(0, [{"uid": f"g{i}", "n": 1, "replica": 0, "row": row} for i, row in enumerate(rows())])
        deadline = time.monotonic() + 120
        while server.requests < 2 * len(rows()) or sum(rid in states for rid in list(server._running)) < len(rows()):
            assert time.monotonic() < deadline, "the second turns never ran together"
            time.sleep(0.001)
        paused = stream.pause()
        push_new()  # SGLang's loop is parked: the engine's synchronous push runs it
        stream.open(1, [])
        records = []
        while len(records) < len(rows()):
            assert time.monotonic() < deadline, "the trajectories did not finish"
            records += stream.poll(0.05)
        stream.pause()
    finally:
        stream.close()
    return {"paused": paused, "records": [{"uid": r.uid, "versions": r.versions, "error": r.error,
                                          "num_turns": r.num_turns, "prompt_ids": r.prompt_ids,
                                          "response_ids": r.response_ids, "response_mask": r.response_mask,
                                          "response_logprobs": r.response_logprobs} for r in records]}


def main(model_dir: str, new_model_dir: str, out_path: str) -> None:
    from transformers import AutoTokenizer

    from verl.engine.rollout.sglang_rollout import SGLangRollout
    from verl.models.config import ModelConfig

    start = time.perf_counter()
    config = ModelConfig.from_pretrained(model_dir)
    with SGLangRollout(config, model_dir, tp_size=1, dtype=torch.float32, max_total_tokens=4096,
                       mem_fraction_static=0.9) as rollout:  # on CPU: a check against host memory others use
        started = time.perf_counter() - start
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        result = {"greedy": run_batch(rollout.token_server(base_params(), pad_token_id=0), tokenizer)}
        server = rollout.token_server(base_params(), pad_token_id=0)
        buffers = rank_buffers(new_model_dir, config, 1, torch.float32)
        result["partial"] = batch_with_a_weight_sync(server, tokenizer, lambda: rollout.update_weights(buffers))
        old_buffers = rank_buffers(model_dir, config, 1, torch.float32)
        result["stream"] = stream_with_a_weight_sync(rollout.token_server(base_params(), pad_token_id=0), tokenizer,
                                                     lambda: rollout.update_weights(old_buffers),
                                                     lambda: rollout.update_weights(buffers))
    result["seconds"] = {"engine_start": started, "total": time.perf_counter() - start}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
