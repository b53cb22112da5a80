"""LoRA vs full fine-tuning GRPO, same workload, one command (issue 45 item 6).

    python launch/bench_lora_vs_full.py --model .cache/smollm2-135m-instruct --prompts 4 --n 8 \\
        --response-length 64 --steps 3 --lora-rank 16 --json outputs/bench_lora_smollm2.json

Runs ``verl bench train`` twice on the same model, batch, lengths, ranks and data: full fine-tuning
(``--full-lr``) and LoRA on every Megatron linear (``actor_rollout_ref.model.lora.rank=R``, ``--lora-lr``),
then prints both records' ``s_per_step``, ``update_actor`` and ``gen`` medians and ``peak_rss_gb`` (the
largest rank) with LoRA-over-full ratios. ``--order`` picks which runs first (on a shared machine the
load drifts; run it both ways to see the spread). Extra ``KEY=VALUE`` arguments go to both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from verl.errors import InputError


def bench_train(args: argparse.Namespace, lr: float, extra: list[str], json_path: str) -> dict:
    cmd = [sys.executable, "-m", "verl.cli", "bench", "train", "--model", args.model, "--prompts", str(args.prompts),
           "--n", str(args.n), "--response-length", str(args.response_length), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--nproc", str(args.nproc), "--tp", str(args.tp), "--lr", str(lr),
           "--json", json_path, "algorithm.rollout_correction.bypass_mode=true", *extra, *args.overrides]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)
    with open(json_path, encoding="utf-8") as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_lora_vs_full", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory or config.json (as verl bench train)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--full-lr", type=float, default=1e-5)
    p.add_argument("--lora-lr", type=float, default=1e-4)
    p.add_argument("--order", choices=("full-first", "lora-first"), default="full-first")
    p.add_argument("--json", help="also write both records and the ratios here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if args.lora_rank < 1:
        raise InputError(f"--lora-rank: expected >= 1, found {args.lora_rank}")
    lora = [f"actor_rollout_ref.model.lora.rank={args.lora_rank}",
            f"actor_rollout_ref.model.lora.alpha={args.lora_alpha}"]
    runs = [("full", args.full_lr, []), ("lora", args.lora_lr, lora)]
    if args.order == "lora-first":
        runs.reverse()
    records = {}
    with tempfile.TemporaryDirectory(prefix="bench_lora_vs_full_") as tmp:
        for name, lr, extra in runs:
            records[name] = bench_train(args, lr, extra, os.path.join(tmp, f"{name}.json"))
    full, lora_rec = records["full"], records["lora"]

    def phase(rec: dict, name: str) -> float:
        return rec["phases"].get(name, 0.0)

    rows = [("s/step", full["s_per_step"], lora_rec["s_per_step"]),
            ("update_actor s", phase(full, "update_actor"), phase(lora_rec, "update_actor")),
            ("gen s", phase(full, "gen"), phase(lora_rec, "gen")),
            ("update_weights s", phase(full, "update_weights"), phase(lora_rec, "update_weights")),
            ("peak RSS GiB (largest rank)", full["peak_rss_gb"], lora_rec["peak_rss_gb"])]
    print(f"{args.model}: {args.prompts} prompts x {args.n}, {args.response_length} new tokens, {args.nproc} ranks "
          f"tp={args.tp}, median of {full['measured_steps']} steps after {args.warmup} warm-up")
    print(f"{'':30s} {'full':>10s} {'lora':>10s} {'lora/full':>10s}")
    for label, a, b in rows:
        print(f"{label:30s} {a:10.3f} {b:10.3f} {b / a if a else float('nan'):10.3f}")
    # LoRA starts as the base model (B = 0): with the same seed both runs' first step samples the same responses.
    same_work = full["first_step_work"] == lora_rec["first_step_work"]
    print(f"same first-step work (prompts, sampled lengths, tokens, score): {same_work}")
    result = {"full": full, "lora": lora_rec, "order": args.order, "same_first_step_work": same_work,
              "ratios": {label: (b / a if a else None) for label, a, b in rows}}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0 if same_work else 1


if __name__ == "__main__":
    sys.exit(main())
