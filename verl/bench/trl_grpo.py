"""The peer-framework baseline of ``verl bench train --baseline trl``: TRL's ``GRPOTrainer`` on the same work.

    python -m verl.bench.trl_grpo --model CONFIG.json --data DIR --prompts 16 --n 4 --response-length 4 \\
        --steps 20 --metrics PATH

TRL is not a dependency of verl-hpc; install it next to torch without letting it pull another one
(``pip install --no-deps trl==1.16.0``, then ``datasets`` and ``pandas`` with torch pinned). The trainer is set
up for the workload ``verl bench train`` runs: HF ``generate`` (no vLLM), ``n`` completions per prompt,
``prompts * n`` completions per optimizer step split evenly over the processes (one process, or several under
``torch.distributed.run``: gloo DDP on the CPU, as ``accelerate launch`` would run it; each process generates
and trains on its share in one micro-batch, as verl's ranks do), one iteration per generation (on-policy: TRL
then skips the old-log-prob forward), no KL term (``beta=0``, no reference model), temperature 1 without
top-k/top-p, AdamW at a constant LR without weight decay, fp32 on the CPU, the same scorer (verl's built-in
one for the data's ``data_source``). Everything else is TRL's default (token-level ``dapo`` loss normalisation
= verl's token-mean, clip 0.2, gradient norm 1.0) except ``gradient_checkpointing``, which TRL turns on by
default: here it is off unless ``--gradient-checkpointing`` (``verl bench train --gradient-checkpointing on`` turns
it on for both sides alike: it trades recompute time for activation memory). Each optimizer step appends, from
the main process, ``timing_s/step``, the mean score and ``perf/total_num_tokens`` (TRL's ``num_tokens``: prompt
+ completion tokens of every process) as one JSON line, read by ``verl.bench.train.summarize``.
"""

from __future__ import annotations

import json
import sys
import time

from verl.bench.hf_grpo import build_parser as hf_parser
from verl.bench.hf_grpo import load_model, read_data_source, read_prompts
from verl.errors import InputError


def main(argv: list[str] | None = None) -> int:
    import os

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl.utils.reward_score import default_compute_score

    parser = hf_parser()
    parser.prog = "python -m verl.bench.trl_grpo"
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="TRL's gradient_checkpointing (its default; off unless given, like verl's actor)")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.data, "tokenizer"), padding_side="left")
    dataset = Dataset.from_list([{"prompt": prompt, "answer": truth}
                                 for prompt, truth in read_prompts(args.data, tokenizer)])
    data_source = read_data_source(args.data)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if (args.prompts * args.n) % processes:
        raise InputError(f"--prompts x --n: expected a multiple of the {processes} processes, found "
                         f"{args.prompts * args.n}")

    def score(completions, answer, **_):
        return [default_compute_score(data_source, text, truth)
                for text, truth in zip(completions, answer, strict=True)]

    records: dict[int, dict] = {}

    class StepTimer(TrainerCallback):
        """Per optimizer step: its wall time, and the mean reward TRL logs right after it."""

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            records[state.global_step] = {"step": state.global_step,
                                          "timing_s/step": time.perf_counter() - self.start}

        seen = 0.0

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "reward" in logs and state.global_step in records:
                records[state.global_step]["critic/score/mean"] = float(logs["reward"])
            if logs and "num_tokens" in logs and state.global_step in records:  # cumulative over the run
                records[state.global_step]["perf/total_num_tokens"] = float(logs["num_tokens"]) - self.seen
                self.seen = float(logs["num_tokens"])

    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "trl_output"),
        per_device_train_batch_size=args.prompts * args.n // processes, gradient_accumulation_steps=1,
        num_generations=args.n, max_completion_length=args.response_length, num_iterations=1,
        beta=0.0, temperature=1.0, top_k=0, top_p=1.0, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, fp16=False, seed=args.seed, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False, gradient_checkpointing=args.gradient_checkpointing)
    trainer = GRPOTrainer(model=load_model(args.model, args.seed, args.linears), reward_funcs=score, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    if trainer.accelerator.is_main_process:
        with open(args.metrics, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(records[step]) + "\n" for step in sorted(records))
    import torch.distributed as dist

    if dist.is_initialized():  # a gloo group left to the interpreter's exit aborted a rank now and then
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
