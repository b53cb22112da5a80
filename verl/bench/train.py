"""`verl bench train`: N GRPO steps of a model config on the arithmetic task, as one JSON record.

    verl bench train --model configs/models/qwen2_tiny_arith.json --prompts 16 --n 4 --response-length 4 \\
        --steps 20 --nproc 2 --tp 1 --rollout-tp 1 --json train.json [KEY=VALUE ...]

Runs ``verl train`` (packaged verl defaults, GRPO, no KL/reference, lr 1e-4 constant, fp32, no
validation/checkpoints/export) in a child process on a freshly written arithmetic dataset with its
character tokenizer, samples the resident memory of every rank while it runs, and reports:

* ``s_per_step``: the median ``timing_s/step`` over the steps after ``--warmup``;
* ``phases``: the median of each ``timing_s/<phase>`` (they add up to the step; ``unaccounted_s`` says
  what is outside them);
* ``tokens_per_s``: prompt + response tokens of a step over its seconds (all ranks together);
* ``peak_rss_gb``: the largest resident set of any one rank, ``wall_s`` and ``cpu_s`` (CPU seconds of every
  process, start-up included) of the whole command.

``--mode colocate_async|separate_async`` runs verl's asynchronous trainers on the same total ranks (a pool takes
``--rollout-ranks`` of them) and adds ``trainer_idle_fraction`` (its wait for a batch over the step),
``rollout_idle_fraction`` and ``staleness_worst_mean``; a long ``--response-length`` on a random-init model gives
the long tail (a response ends when the model samples EOS, about once in a vocabulary's worth of tokens).

Extra ``KEY=VALUE`` arguments are passed to ``verl train`` as overrides (e.g. a bigger
``data.max_response_length`` or ``actor_rollout_ref.actor.ppo_epochs=2``). The child's output goes to
``<workdir>/train.log``.

``--baseline hf`` also runs the same workload (model, batch, lengths, LR, steps) through
:mod:`verl.bench.hf_grpo` -- one process, transformers ``generate`` and one on-policy update per step, the
shape of a peer trainer built on HF -- right after ``verl train`` in the same command, and adds its record
under ``baseline``, ``speedup`` = baseline s/step over ours (> 1: ``verl train`` is faster),
``tokens_per_s_ratio`` (ours over theirs) and ``peak_rss_ratio`` (ours over theirs: < 1, ``verl train`` peaks lower).
``--baseline trl`` runs TRL's ``GRPOTrainer`` instead (:mod:`verl.bench.trl_grpo`; TRL is not a
dependency) on the same ``--nproc`` ranks (``torch.distributed.run``, gloo, one thread per rank as verl's ranks),
so ``peak_rss_gb`` (the largest process) is per rank on both sides. Both baselines are on-policy without an
old-log-prob forward, and so is ``verl train`` at its defaults on this workload (one PPO epoch over one mini-batch:
the update's own forward gives the old log-probs, ``old_log_prob = log_prob.detach()``, TRL's formula), so each
side does the same work per step. ``--baseline-first`` runs the baseline first (run a pair, one of each order).

``--task``: the arithmetic task with its character tokenizer (a model config.json, random init), or
``word_problems`` (``verl data word-problems``) rendered by the model's own tokenizer and chat template (an HF
model directory with a tokenizer: a real checkpoint); ``auto`` picks by the model. A real-checkpoint run
(issue 43's workload: SmolLM2-135M-Instruct, 8 prompts x 4 samples, 32 new tokens, fp32, 2 ranks)::

    verl bench train --model .cache/smollm2-135m-instruct --prompts 8 --n 4 --response-length 32 --steps 7 \
        --baseline trl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from verl.errors import InputError

NESTED_PHASES = ("generate_sequences",)  # timed inside another phase (gen): not part of the sum


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/models/qwen2_tiny_arith.json",
                        help="HF config.json (random init) or HF model directory")
    parser.add_argument("--prompts", type=_positive, default=16, help="prompts per step (data.train_batch_size)")
    parser.add_argument("--n", type=_positive, default=4, help="responses per prompt (rollout.n)")
    parser.add_argument("--response-length", type=_positive, default=4, help="max new tokens per response")
    parser.add_argument("--steps", type=_positive, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--nproc", type=_positive, default=2, help="local ranks")
    parser.add_argument("--tp", type=_positive, default=1, help="actor tensor parallel size")
    parser.add_argument("--pp", type=_positive, default=1, help="actor pipeline parallel size")
    parser.add_argument("--rollout-tp", type=_positive, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--workdir", help="where data, logs and metrics go (default: a temporary directory)")
    parser.add_argument("--baseline", choices=("none", "hf", "trl"), default="none",
                        help="also run the same workload through a single-process transformers GRPO loop (hf) or "
                             "TRL's GRPOTrainer (trl, when installed) and print the ratio")
    parser.add_argument("--mode", choices=("sync", "colocate_async", "separate_async"), default="sync",
                        help="verl's trainer.v1.trainer_mode; separate_async gives --rollout-ranks of the --nproc "
                             "ranks to a standalone rollout pool (the same total ranks as the other modes)")
    parser.add_argument("--task", choices=("auto", "arithmetic", "word_problems"), default="auto",
                        help="arithmetic (character tokenizer) or word_problems (the model's own tokenizer and chat "
                             "template); auto: word_problems for an HF directory with a tokenizer")
    parser.add_argument("--gradient-checkpointing", choices=("off", "on"), default="off",
                        help="activation recompute on both sides alike: verl's actor_rollout_ref.model."
                             "enable_gradient_checkpointing (every layer) and TRL's gradient_checkpointing (TRL's own "
                             "default is on; off here unless asked, so both trade memory for time the same way)")
    parser.add_argument("--rollout-ranks", type=_positive, default=1, help="separate_async: the pool's ranks")
    parser.add_argument("--roofline", action="store_true",
                        help="also measure this machine's matmul rate and memory bandwidth (torch, every core) and "
                             "report each phase of verl train's step against them (verl.bench.roofline)")
    parser.add_argument("--baseline-linears", choices=("torch", "onednn"), default="torch",
                        help="the baseline's fp32 linears: torch's default path (MKL, the baseline's own default) "
                             "or oneDNN's, as verl-hpc's engines run theirs (the GEMM library set aside)")
    parser.add_argument("--baseline-first", action="store_true",
                        help="run the baseline before verl train (a pair of runs in both orders shows what running "
                             "second on a warmer, busier machine costs)")
    parser.add_argument("--json", help="also write the record here")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="extra verl train overrides")
    return parser


def train_command(args: argparse.Namespace, data_dir: str, output_dir: str, prompt_length: int = 8) -> list[str]:
    """``verl train`` on the written data; ``prompt_length`` is the longest prompt in tokens (verl left-pads
    every prompt to ``data.max_prompt_length``, so a looser bound would only add padded positions)."""
    batch = args.prompts
    mode = getattr(args, "mode", "sync")
    training = args.nproc - args.rollout_ranks if mode == "separate_async" else args.nproc
    per_rank = max(1, batch * args.n // max(1, training // (args.tp * args.pp)))  # one micro-batch per rank
    placement = [f"trainer.v1.trainer_mode={mode}"]
    if mode == "separate_async":  # one mini-batch update per weight sync (verl: batch = sync steps x mini-batch)
        placement += ["actor_rollout_ref.rollout.nnodes=1",
                      f"actor_rollout_ref.rollout.n_gpus_per_node={args.rollout_ranks}",
                      "trainer.v1.separate_async.parameter_sync_step=1"]
    return [
        sys.executable, "-m", "verl.trainer.main_ppo", "--config-name=ppo_megatron_trainer",
        f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
        f"data.tokenizer={data_dir}/tokenizer", f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={args.response_length}", f"data.train_batch_size={batch}",
        f"actor_rollout_ref.model.path={os.path.abspath(args.model)}",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=False",
        f"actor_rollout_ref.actor.optim.lr={args.lr}", f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={per_rank}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={per_rank}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={args.rollout_tp}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={args.tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={args.pp}",
        f"trainer.n_gpus_per_node={training}", f"trainer.total_training_steps={args.steps}", *placement,
        # Named either way: the baseline has it off unless asked, so verl-hpc's own choice by memory stays out.
        "actor_rollout_ref.model.enable_gradient_checkpointing="
        f"{getattr(args, 'gradient_checkpointing', 'off') == 'on'}",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.export_hf_at_end=False", "trainer.resume_mode=disable", "trainer.logger=[console]",
        f"trainer.output_dir={output_dir}", *args.overrides,
    ]


def _tree_peak_rss(process, peak: int, cpu: dict[int, float] | None = None) -> int:
    """The largest resident set of ``process`` and its descendants so far; ``cpu`` (pid -> user + system
    seconds, the latest sample of each process) is updated on the way."""
    import psutil

    try:
        procs = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return peak
    for proc in procs:
        try:
            peak = max(peak, proc.memory_info().rss)
            if cpu is not None:
                times = proc.cpu_times()
                cpu[proc.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return peak


BASELINES = {"hf": "verl.bench.hf_grpo", "trl": "verl.bench.trl_grpo"}


def baseline_command(args: argparse.Namespace, data_dir: str, metrics: str) -> list[str]:
    """The baseline's command: TRL on ``--nproc`` ranks (torch.distributed.run, as ``accelerate launch`` does),
    the single-process HF loop as one process."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"] \
        if args.baseline == "trl" and args.nproc > 1 else [sys.executable]
    return [*launcher, "-m", BASELINES[args.baseline], "--model", os.path.abspath(args.model), "--data", data_dir,
            "--prompts", str(args.prompts), "--num-generations", str(args.n),
            "--response-length", str(args.response_length),
            "--steps", str(args.steps), "--lr", str(args.lr), "--metrics", metrics,
            "--linears", args.baseline_linears,
            *(["--gradient-checkpointing"] if args.baseline == "trl" and args.gradient_checkpointing == "on" else [])]


def _run_watched(command: list[str], log_path: str, log_kept: bool = True) -> dict | int:
    """Run ``command`` with its output in ``log_path``, sampling the resident memory of its process tree:
    ``{"peak_rss_gb", "wall_s"}``, or its exit code after one line on stderr when it fails. ``log_kept``
    False: the log lives in a temporary workdir that is about to be removed, so the line does not point at it."""
    import psutil

    start, peak, cpu = time.perf_counter(), 0, {}
    with open(log_path, "w", encoding="utf-8") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        watched = psutil.Process(child.pid)
        while child.poll() is None:
            peak = _tree_peak_rss(watched, peak, cpu)
            time.sleep(0.05)
    wall = time.perf_counter() - start
    if child.returncode != 0:
        with open(log_path, encoding="utf-8") as fh:
            tail = fh.read().strip().splitlines()[-1:] or [""]
        where = f"log: {log_path}" if log_kept else "--workdir DIR keeps the full log"
        module = command[len(command) - command[::-1].index("-m")] if "-m" in command else command[0]
        print(f"verl bench train: {os.path.basename(module)} exited {child.returncode}: {tail[0]} ({where})",
              file=sys.stderr)
        return child.returncode
    # cpu_s: CPU seconds of the whole command (every process, start-up included, sampled every 50 ms): the work
    # done, which other load on shared cores does not stretch the way it stretches wall time.
    return {"peak_rss_gb": peak / 2**30, "wall_s": wall, "cpu_s": sum(cpu.values())}


FIRST_STEP_WORK = ("prompt_length/mean", "response_length/mean", "response_length/max", "perf/total_num_tokens",
                   "critic/score/mean")


def summarize(records: list[dict], warmup: int) -> dict:
    steps = [r for r in records if "timing_s/step" in r]
    if not steps:
        raise ValueError("verl bench train: expected per-step metrics from verl train, found none")
    measured = steps[warmup:] if len(steps) > warmup else steps
    phase_names = sorted({k.split("/", 1)[1] for r in measured for k in r
                          if k.startswith("timing_s/") and k != "timing_s/step"})
    phases = {name: statistics.median(r.get(f"timing_s/{name}", 0.0) for r in measured) for name in phase_names}
    step_s = statistics.median(r["timing_s/step"] for r in measured)
    summed = sum(v for k, v in phases.items() if k not in NESTED_PHASES)
    tokens = [r["perf/total_num_tokens"] / r["timing_s/step"] for r in measured if "perf/total_num_tokens" in r]
    def median(key: str, default: float | None = None) -> float | None:
        values = [r[key] for r in measured if key in r]
        return statistics.median(values) if values else default

    # The trainer idles while it waits for a batch (timing_s/gen); the rollout idles outside generation
    # (colocated) or outside its segments (a pool: rollout/busy_s).
    gen = [r.get("timing_s/gen", 0.0) / r["timing_s/step"] for r in measured]
    busy = [r["rollout/busy_s"] / r["timing_s/step"] for r in measured if "rollout/busy_s" in r]
    step_times = [r["timing_s/step"] for r in measured]
    return {"steps": len(steps), "measured_steps": len(measured), "s_per_step": step_s,
            "s_per_step_range": [min(step_times), max(step_times)], "phases": phases,
            "unaccounted_s": step_s - summed, "tokens_per_s": statistics.median(tokens) if tokens else None,
            "trainer_idle_fraction": statistics.median(gen),
            "rollout_idle_fraction": max(0.0, 1 - statistics.median(busy)) if busy else 1 - statistics.median(gen),
            "staleness_worst_mean": median("training/off_policy/trajectory_staleness_worst/mean", 0.0),
            "response_length": {stat: median(f"response_length/{stat}") for stat in ("mean", "min", "max")},
            "final_score": steps[-1].get("critic/score/mean"),
            # What step 1 sampled and scored (before any update): equal on two runs that start from the same
            # weights and seed, however they train (the LoRA-vs-full bench checks its two sides with it).
            "first_step_work": {k: steps[0].get(k) for k in FIRST_STEP_WORK}}


def resolve_task(task: str, model: str) -> str:
    """``auto``: word_problems for an HF model directory that carries a tokenizer (a real checkpoint), else
    arithmetic (a config.json to initialise at random, or a directory without a tokenizer)."""
    if task != "auto":
        return task
    has_tokenizer = os.path.isdir(model) and any(
        os.path.isfile(os.path.join(model, name)) for name in ("tokenizer.json", "tokenizer_config.json"))
    return "word_problems" if has_tokenizer else "arithmetic"


def write_bench_data(data_dir: str, train_prompts: int, task: str = "arithmetic", model: str | None = None) -> int:
    """The task's data in ``data_dir`` (``train_prompts`` training and 16 test problems, ``train.parquet`` /
    ``test.parquet``) and the tokenizer every side reads (``tokenizer/``): arithmetic with its character
    tokenizer, or word problems with ``model``'s own tokenizer. Returns the longest rendered prompt in tokens."""
    os.makedirs(data_dir, exist_ok=True)
    tokenizer_dir = os.path.join(data_dir, "tokenizer")
    if task == "arithmetic":
        from verl.utils.dataset.arithmetic import build_char_tokenizer, generate_problems, make_row, write_parquet

        train, test = generate_problems(train_prompts, 16, seed=0)
        train_rows = [make_row(p, "train", i) for i, p in enumerate(train)]
        write_parquet(train_rows, os.path.join(data_dir, "train.parquet"))
        write_parquet([make_row(p, "test", i) for i, p in enumerate(test)], os.path.join(data_dir, "test.parquet"))
        build_char_tokenizer(tokenizer_dir)
        return max(len(row["prompt"][0]["content"]) for row in train_rows)
    if task != "word_problems":
        raise InputError(f"--task: expected one of arithmetic, word_problems, found {task}")
    from transformers import AutoTokenizer

    from verl.utils.dataset.arithmetic import write_parquet
    from verl.utils.dataset.rl_dataset import render_prompt
    from verl.utils.dataset.word_problems import generate_problems, make_row

    if model is None or not os.path.isdir(model):
        raise InputError(f"--task word_problems: expected an HF model directory with a tokenizer, found {model}")
    tokenizer = AutoTokenizer.from_pretrained(model)
    train, test = generate_problems(train_prompts, 16, seed=0)
    train_rows = [make_row(p, "train", i) for i, p in enumerate(train)]
    write_parquet(train_rows, os.path.join(data_dir, "train.parquet"))
    write_parquet([make_row(p, "test", i) for i, p in enumerate(test)], os.path.join(data_dir, "test.parquet"))
    tokenizer.save_pretrained(tokenizer_dir)
    # As RLHFDataset tokenises a prompt: the rendered chat, no special tokens added.
    return max(len(tokenizer(render_prompt(row["prompt"], tokenizer), add_special_tokens=False)["input_ids"])
               for row in train_rows)


def _roofline(args: argparse.Namespace, records: list[dict]) -> dict:
    """verl train's phases against this machine's limits, measured now (nothing else of this command runs)."""
    from verl.bench.roofline import machine_limits, model_matmul_params, phase_bounds

    limits = machine_limits()
    dtype_bytes = 2 if any(o.endswith(("dtype=bfloat16", "dtype=bf16")) for o in args.overrides) else 4
    phases = phase_bounds(records, args.warmup, model_matmul_params(args.model), limits,
                          rows=args.prompts * args.n, n=args.n, replicas=max(1, args.nproc // args.rollout_tp),
                          dtype_bytes=dtype_bytes, recompute=args.gradient_checkpointing == "on")
    return {"machine": limits, "phases": phases}


def roofline_table(roofline: dict) -> str:
    from verl.bench.roofline import table

    return table(roofline)


def main(argv: list[str] | None = None) -> int:
    from verl.utils.tracking import read_metrics

    args = build_parser().parse_args(argv)
    if args.warmup < 0:
        raise InputError(f"--warmup: expected >= 0, found {args.warmup}")
    if args.baseline == "trl" and importlib.util.find_spec("trl") is None:
        raise InputError("--baseline trl: expected TRL importable next to this torch (pip install --no-deps trl "
                         "accelerate datasets), found no module 'trl'")
    if args.gradient_checkpointing == "on" and args.baseline == "hf":
        raise InputError("--gradient-checkpointing on: expected --baseline trl or none (the hf loop has no activation "
                         "recompute), found --baseline hf")
    if not os.path.exists(args.model):
        raise InputError(f"--model: expected an HF config.json or model directory, found nothing at {args.model}")
    with tempfile.TemporaryDirectory(prefix="verl_bench_train_") as tmp:
        workdir = os.path.abspath(args.workdir or tmp)
        data_dir, output_dir = os.path.join(workdir, "data"), os.path.join(workdir, "out")
        task = resolve_task(args.task, args.model)
        prompt_length = write_bench_data(data_dir, max(4 * args.prompts, 256), task, args.model)
        metrics = os.path.join(workdir, "baseline_metrics.jsonl")

        def baseline():
            return _run_watched(baseline_command(args, data_dir, metrics), os.path.join(workdir, "baseline.log"),
                                log_kept=bool(args.workdir))

        theirs = baseline() if args.baseline != "none" and args.baseline_first else None
        if isinstance(theirs, int):
            return theirs
        ours = _run_watched(train_command(args, data_dir, output_dir, prompt_length),
                            os.path.join(workdir, "train.log"), log_kept=bool(args.workdir))
        if isinstance(ours, int):
            return ours
        record = {"model": args.model, "task": task, "gradient_checkpointing": args.gradient_checkpointing,
                  "mode": args.mode, "nproc": args.nproc, "tp": args.tp,
                  "pp": args.pp,
                  "rollout_tp": args.rollout_tp, "prompts": args.prompts, "n": args.n,
                  "response_length": args.response_length, "overrides": args.overrides,
                  **summarize(read_metrics(output_dir), args.warmup), **ours}
        if args.roofline:
            record["roofline"] = _roofline(args, read_metrics(output_dir))
            print(roofline_table(record["roofline"]), file=sys.stderr)
        if args.baseline != "none":
            if theirs is None:
                theirs = baseline()
                if isinstance(theirs, int):
                    return theirs
            record["baseline_first"] = args.baseline_first
            record["baseline"] = {"name": args.baseline, "linears": args.baseline_linears,
                                  **summarize(read_metrics(metrics), args.warmup), **theirs}
            record["speedup"] = record["baseline"]["s_per_step"] / record["s_per_step"]
            if record["tokens_per_s"] and record["baseline"]["tokens_per_s"]:
                record["tokens_per_s_ratio"] = record["tokens_per_s"] / record["baseline"]["tokens_per_s"]
            # Ours over theirs, the largest process on each side (< 1: verl train peaks lower).
            record["peak_rss_ratio"] = record["peak_rss_gb"] / record["baseline"]["peak_rss_gb"]
            record["cpu_s_ratio"] = record["baseline"]["cpu_s"] / max(record["cpu_s"], 1e-9)  # > 1: we used less
    text = json.dumps(record, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
