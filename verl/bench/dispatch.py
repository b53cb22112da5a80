"""`verl bench dispatch`: what the controller moves per rank per step, data plane vs legacy all-gather.

    verl bench dispatch --nproc 2,4,8,16 --json dispatch.json        # both paths at each N, weak scaling
    verl bench dispatch --nproc 8 --legacy                           # today's path only

GRPO steps of a tiny model on the arithmetic task (``verl bench train``'s workload: actor TP 2, rollout
TP 1, so rows move between the rollout's and the actor's replicas), at every N with the same rows per rank
(``--rows-per-rank``: ``data.train_batch_size`` = rows_per_rank x N / n). Each path runs in its own
``verl train`` (``transfer_queue.enable`` true or false) and reports, as the median over the steps after the
first, the most any rank saw:

* ``bytes_received_per_rank``: row values (tensors and objects) plus object-collective bytes that arrived;
* ``shard_bytes_per_rank``: what the rank's workers consumed (the tensors of their DataProto arguments);
* ``object_collective_bytes``: the part that arrived through object collectives (the legacy path's batches,
  the data plane's metadata);
* ``dispatch_seconds``: time spent moving rows and metadata; ``peak_rss_mb_per_rank``.

``received_over_shard`` is the issue's measure (goal: <= 1.2 at every N on the data plane); each N also
prints ``legacy_over_data_plane`` for the bytes received.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from verl.errors import InputError

KEYS = {"bytes_received_per_rank": "perf/data_plane_received_mb", "shard_bytes_per_rank": "perf/data_plane_shard_mb",
        "object_collective_bytes": "perf/data_plane_object_mb", "dispatch_seconds": "perf/data_plane_seconds",
        "peak_rss_mb_per_rank": "perf/data_plane_peak_rss_mb"}
MB = 2**20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl bench dispatch", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4,8,16", help="local ranks: one N or a comma list (even: actor TP 2)")
    parser.add_argument("--legacy", action="store_true", help="today's all-gather path only")
    parser.add_argument("--no-legacy", action="store_true", help="the data plane only")
    parser.add_argument("--rows-per-rank", type=int, default=32, help="responses per rank per step (weak scaling)")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (rollout.n)")
    parser.add_argument("--response-length", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per run (the first is left out)")
    parser.add_argument("--model", default="configs/models/qwen2_tiny_arith.json")
    parser.add_argument("--workdir", help="where data, logs and metrics go (default: a temporary directory)")
    parser.add_argument("--json", help="also write the records here")
    return parser


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--nproc: expected a number or a comma list of numbers, found {text!r}") from None
    if not counts or any(n < 2 or n % 2 for n in counts):
        raise InputError(f"--nproc: expected even rank counts >= 2 (the actor runs at TP 2), found {text!r}")
    return counts


def run_path(args: argparse.Namespace, nproc: int, data_plane: bool, data_dir: str, workdir: str,
             prompt_length: int) -> dict:
    from verl.bench.train import _run_watched, train_command
    from verl.utils.tracking import read_metrics

    prompts = max(1, args.rows_per_rank * nproc // args.n)
    name = f"{'data_plane' if data_plane else 'legacy'}_n{nproc}"
    output_dir = os.path.join(workdir, name)
    train_args = argparse.Namespace(
        prompts=prompts, n=args.n, nproc=nproc, tp=2, pp=1, rollout_tp=1, response_length=args.response_length,
        model=args.model, lr=1e-4, steps=args.steps,
        overrides=[f"transfer_queue.enable={str(data_plane).lower()}", "trainer.balance_batch=true"])
    env_before = os.environ.get("VERL_DATA_PLANE_STATS")
    os.environ["VERL_DATA_PLANE_STATS"] = "1"  # the legacy path's figures too
    try:
        watched = _run_watched(train_command(train_args, data_dir, output_dir, prompt_length),
                               os.path.join(workdir, f"{name}.log"), log_kept=bool(args.workdir))
    finally:
        if env_before is None:
            os.environ.pop("VERL_DATA_PLANE_STATS", None)
        else:
            os.environ["VERL_DATA_PLANE_STATS"] = env_before
    if isinstance(watched, int):
        raise RuntimeError(f"verl bench dispatch: verl train exited {watched} at --nproc {nproc} "
                           f"({'data plane' if data_plane else 'legacy'})")
    steps = [r for r in read_metrics(output_dir) if "perf/data_plane_received_mb" in r]
    measured = steps[1:] if len(steps) > 1 else steps
    record = {"nproc": nproc, "path": "data_plane" if data_plane else "legacy", "prompts": prompts,
              "rows": prompts * args.n, "steps": len(steps)}
    for key, metric in KEYS.items():
        value = statistics.median(r[metric] for r in measured)
        record[key] = value if key in ("dispatch_seconds", "peak_rss_mb_per_rank") else int(value * MB)
    record["received_over_shard"] = record["bytes_received_per_rank"] / max(1, record["shard_bytes_per_rank"])
    record["s_per_step"] = statistics.median(r["timing_s/step"] for r in measured)
    return record


def main(argv: list[str] | None = None) -> int:
    from verl.bench.train import write_bench_data

    args = build_parser().parse_args(argv)
    counts = _counts(args.nproc)
    if args.legacy and args.no_legacy:
        raise InputError("--legacy and --no-legacy: expected at most one, found both")
    if args.steps < 2:
        raise InputError(f"--steps: expected >= 2 (the first step is left out), found {args.steps}")
    if not os.path.exists(args.model):
        raise InputError(f"--model: expected an HF config.json or model directory, found nothing at {args.model}")
    paths = [False] if args.legacy else [True] if args.no_legacy else [True, False]
    records = []
    with tempfile.TemporaryDirectory(prefix="verl_bench_dispatch_") as tmp:
        workdir = os.path.abspath(args.workdir or tmp)
        data_dir = os.path.join(workdir, "data")
        most_prompts = max(args.rows_per_rank * n // args.n for n in counts)
        prompt_length = write_bench_data(data_dir, max(2 * most_prompts, 256))
        for nproc in counts:
            for data_plane in paths:
                record = run_path(args, nproc, data_plane, data_dir, workdir, prompt_length)
                records.append(record)
                print(f"N={nproc:>3} {record['path']:<10} received {record['bytes_received_per_rank'] / 1024:9.1f} KiB"
                      f"  shard {record['shard_bytes_per_rank'] / 1024:8.1f} KiB  ratio "
                      f"{record['received_over_shard']:6.2f}  objects {record['object_collective_bytes'] / 1024:8.1f}"
                      f" KiB  move {record['dispatch_seconds']:.3f}s  rss {record['peak_rss_mb_per_rank']:.0f} MB",
                      flush=True)
            both = [r for r in records if r["nproc"] == nproc]
            if len(both) == 2:
                ours, theirs = both
                print(f"N={nproc:>3} legacy_over_data_plane (bytes received): "
                      f"{theirs['bytes_received_per_rank'] / max(1, ours['bytes_received_per_rank']):.1f}x", flush=True)
    text = json.dumps(records, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
