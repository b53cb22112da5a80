"""What re-prefilling costs the native engine's agent turns (it keeps no KV cache across turns): one batched turn
of ``--batch`` trajectories whose ``PREFIX`` tokens are prefilled again before it decodes ``--decode`` tokens,
against the same turn prefilling only the ``--appended`` tokens (what a kept cache would prefill; its decode
attention would still span the whole prefix, a small share at these lengths). Medians of 3.

    python launch/bench_agent_reprefill.py .cache/smollm2-135m-instruct --prefix 156 --appended 12 --decode 12
"""
import argparse
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python launch/bench_agent_reprefill.py", description=__doc__.split("\n")[0])
    p.add_argument("model", help="an HF model directory")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prefix", type=int, default=156, help="tokens before the turn (prompt and earlier turns)")
    p.add_argument("--appended", type=int, default=12, help="tokens appended since the last turn (tool answer)")
    p.add_argument("--decode", type=int, default=12, help="tokens the turn generates")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"model: expected an HF directory with config.json, found {args.model!r}", file=sys.stderr)
        return 2
    if min(args.batch, args.prefix, args.appended, args.decode) < 1 or args.appended > args.prefix:
        print("--batch/--prefix/--appended/--decode: expected positive counts with appended <= prefix, found "
              f"{args.batch}/{args.prefix}/{args.appended}/{args.decode}", file=sys.stderr)
        return 2
    import torch

    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig

    torch.manual_seed(0)
    engine = NativeRollout(ModelConfig.from_pretrained(args.model), pad_token_id=0)
    engine.load_hf_checkpoint(args.model)
    params = SamplingParams(response_length=args.decode, ignore_eos=True, temperature=1.0, seed=1)

    def turn(prefix: int) -> float:
        ids = torch.randint(100, min(40000, engine.config.vocab_size), (args.batch, prefix))
        t0 = time.perf_counter()
        engine.generate_responses(ids, torch.ones_like(ids), params, 0)
        return time.perf_counter() - t0

    turn(args.appended)  # warm-up
    full = statistics.median(turn(args.prefix) for _ in range(3))
    appended = statistics.median(turn(args.appended) for _ in range(3))
    print(f"batch {args.batch}, prefix {args.prefix}, appended {args.appended}, decode {args.decode}: "
          f"re-prefilled turn {full:.2f} s, appended-only turn {appended:.2f} s, re-prefill {full - appended:.2f} s "
          f"({(full - appended) / full:.0%} of the turn)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
