"""The native engine's K/V kept across agent turns (``rollout.enable_prefix_caching``) against prefilling each
turn's whole trajectory again: a real agent batch (the calculator job's problems, its tool YAML and turn limits,
greedy) through the native token server on the same engine, with the cache off, then on, then off again. Prints
each run's seconds, the turn-prompt tokens and the share not computed again, the ratio off / on, and whether the
trajectories agree (token ids and masks; log-probs within 1e-4).

    python launch/bench_agent_prefix_cache.py outputs/sft_smollm2_calculator/hf data/calculator_problems/test.parquet
"""
import argparse
import os
import sys
import time


def measure(model: str, data: str, rows: int, tools: str, response_length: int, max_assistant_turns: int,
            tool_format: str = "hermes", turn_tokens: int | None = None) -> dict:
    """The three runs (cache off, on, off) of the same greedy agent batch on one engine: ``{"runs": [{"name",
    "seconds", "calls", "turns", "prompt_tokens", "cached_tokens", "outputs"}, ...], "same": trajectories equal with
    and without the cache, "rows"}``. ``turn_tokens``: each turn's max_tokens (None: the response budget)."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer

    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.experimental.agent_loop import AgentLoopRunner
    from verl.models.config import ModelConfig

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model)
    engine = NativeRollout(ModelConfig.from_pretrained(model), pad_token_id=tok.pad_token_id or 0)
    engine.load_hf_checkpoint(model)
    table = pq.read_table(data).to_pylist()[:rows]
    batch = [{"raw_prompt": r["prompt"], "agent_name": r.get("agent_name"), "extra_info": r.get("extra_info") or {},
              "tools_kwargs": (r.get("extra_info") or {}).get("tools_kwargs") or {}} for r in table]
    config = {"actor_rollout_ref": {"rollout": {
        "prompt_length": 4096, "response_length": response_length,
        "multi_turn": {"format": tool_format, "tool_config_path": tools,
                       "max_assistant_turns": max_assistant_turns, "max_parallel_calls": 1,
                       "max_tool_response_length": 64, "tool_response_truncate_side": "middle"},
        "agent": {"default_agent_loop": "tool_agent"}}}}
    params = SamplingParams(do_sample=False, response_length=response_length, eos_token_id=(tok.eos_token_id,))

    def run(name: str, caching: bool) -> dict:
        engine.prefix_caching = caching
        server = engine.token_server(params, pad_token_id=engine.pad_token_id)
        runner = AgentLoopRunner(config, server, tok)
        t0 = time.perf_counter()
        sampling = {"temperature": 0.0, "logprobs": True, **({"max_tokens": turn_tokens} if turn_tokens else {})}
        result = server.run(runner.generate(batch, sampling))
        seconds = time.perf_counter() - t0
        server.close()
        return {"name": name, "seconds": seconds, "calls": server.calls, "prompt_tokens": server.prompt_tokens,
                "cached_tokens": server.cached_tokens, "outputs": result.outputs,
                "turns": sum(o.num_turns for o in result.outputs) / len(result.outputs)}

    runs = [run("off", False), run("on", True), run("off", False)]  # off twice: the box's drift shows
    same = 0
    for a, b in zip(runs[0]["outputs"], runs[1]["outputs"], strict=True):
        close = max((abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs, strict=True)), default=0)
        same += a.response_ids == b.response_ids and a.response_mask == b.response_mask and close <= 1e-4
    return {"runs": runs, "same": same, "rows": len(batch)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python launch/bench_agent_prefix_cache.py", description=__doc__.split("\n")[0])
    p.add_argument("model", help="an HF chat model directory (the calculator job's SFT checkpoint)")
    p.add_argument("data", help="a parquet of agent rows (verl data calculator-problems: test.parquet)")
    p.add_argument("--rows", type=int, default=32, help="trajectories in the batch")
    p.add_argument("--tools", default="configs/tools/calculator.yaml", help="verl's tool YAML")
    p.add_argument("--response-length", type=int, default=80)
    p.add_argument("--max-assistant-turns", type=int, default=3)
    p.add_argument("--format", default="hermes", help="the tool-call format (verl's multi_turn.format)")
    p.add_argument("--turn-tokens", type=int, default=None, help="each turn's max_tokens (default: the budget)")
    args = p.parse_args(argv)
    for path, what in ((os.path.join(args.model, "config.json"), "model: an HF directory with config.json"),
                       (args.data, "data: a parquet file"), (args.tools, "--tools: a tool YAML")):
        if not os.path.isfile(path):
            print(f"{what.split(':')[0]}: expected {what.split(': ')[1]}, found nothing at {path}", file=sys.stderr)
            return 2
    if args.rows < 1:
        print(f"--rows: expected a positive count, found {args.rows}", file=sys.stderr)
        return 2
    result = measure(args.model, args.data, args.rows, args.tools, args.response_length, args.max_assistant_turns,
                     args.format, args.turn_tokens)
    runs = result["runs"]
    for r in runs:
        print(f"prefix cache {r['name']:3s}: {r['seconds']:6.2f} s, {r['calls']} engine calls, {r['turns']:.2f} "
              f"turns/trajectory, {r['prompt_tokens']} turn-prompt tokens, {r['cached_tokens']} "
              f"({r['cached_tokens'] / max(r['prompt_tokens'], 1):.0%}) from kept K/V")
    off = min(runs[0]["seconds"], runs[2]["seconds"])
    print(f"off / on: {off / runs[1]['seconds']:.2f}x (the faster cache-off run against the cache-on run)")
    print(f"trajectories identical with and without the cache: {result['same']}/{result['rows']}")
    return 0 if result["same"] == result["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
