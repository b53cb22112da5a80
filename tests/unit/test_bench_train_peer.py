"""`verl bench train` against a peer on a real checkpoint (issue 43 item 5), without running either trainer: the
task follows the model (word problems in the checkpoint's own chat template for an HF directory with a tokenizer),
TRL runs on the same ranks under torch.distributed.run with arguments its launcher passes on, and activation
recompute is switched on both sides alike."""

import os

import pyarrow.parquet as pq
from helpers.real_model import smollm2_dir

from verl.bench.train import baseline_command, build_parser, resolve_task, train_command, write_bench_data


def test_a_real_checkpoint_gets_word_problems_in_its_own_chat_template(tmp_path):
    from transformers import AutoTokenizer

    model = smollm2_dir()
    assert resolve_task("auto", model) == "word_problems"
    assert resolve_task("auto", "configs/models/qwen2_tiny_arith.json") == "arithmetic"
    longest = write_bench_data(str(tmp_path), 32, "word_problems", model)
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 32 and {r["data_source"] for r in rows} == {"word_problems"}
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template  # the checkpoint's, not a char one
    rendered = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    assert longest == max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in rendered)
    assert rendered[0].startswith("<|im_start|>system") and 40 < longest < 80


def test_trl_runs_on_the_same_ranks_with_arguments_its_launcher_passes_on(tmp_path):
    from torch.distributed.run import get_args_parser

    args = build_parser().parse_args(["--model", "m", "--prompts", "8", "--n", "4", "--response-length", "32",
                                      "--baseline", "trl", "--nproc", "2", "--gradient-checkpointing", "on"])
    command = baseline_command(args, str(tmp_path), str(tmp_path / "m.jsonl"))
    assert command[1:3] == ["-m", "torch.distributed.run"]
    launcher = get_args_parser().parse_args(command[3:])  # an ambiguous --n here would exit 2
    assert launcher.nproc_per_node == "2" and launcher.module and launcher.training_script == "verl.bench.trl_grpo"
    from verl.bench.trl_grpo import hf_parser

    parser = hf_parser()
    parser.add_argument("--gradient-checkpointing", action="store_true")
    trl = parser.parse_args(launcher.training_script_args)
    assert (trl.n, trl.prompts, trl.response_length, trl.gradient_checkpointing) == (4, 8, 32, True)
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=True" in train_command(args, "d", "o")
    args.gradient_checkpointing = "off"
    assert "--gradient-checkpointing" not in baseline_command(args, "d", "m")
    # Off on both sides alike: named on verl-hpc's side, whose own default is chosen by memory.
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=False" in train_command(args, "d", "o")
    args.nproc = 1  # one process: no launcher
    assert baseline_command(args, "d", "m")[1:3] == ["-m", "verl.bench.trl_grpo"]
    assert os.path.basename(baseline_command(args, "d", "m")[0]).startswith("python")


def test_the_baselines_linears_follow_baseline_linears(tmp_path):
    import pytest
    import torch
    from helpers.tolerance import logits_tolerance

    from verl.bench.hf_grpo import load_model
    from verl.errors import InputError

    args = build_parser().parse_args(["--model", "m", "--baseline", "trl", "--nproc", "2"])
    command = baseline_command(args, "d", "m")
    assert command[command.index("--linears") + 1] == "torch"  # the baseline's own default: torch's GEMM
    args = build_parser().parse_args(["--model", "m", "--baseline", "hf", "--baseline-linears", "onednn"])
    command = baseline_command(args, "d", "m")
    assert command[command.index("--linears") + 1] == "onednn"
    config = "configs/models/qwen2_tiny_arith.json"
    plain, routed = load_model(config, 0), load_model(config, 0, "onednn")
    linears = [m for m in routed.modules() if type(m) is torch.nn.Linear]
    assert linears and all(getattr(m.forward, "onednn", False) for m in linears)
    assert not any(getattr(m.forward, "onednn", False) for m in plain.modules() if type(m) is torch.nn.Linear)
    ids = torch.tensor([[1, 5, 9, 3]])
    want = plain(ids).logits
    # two fp32 evaluations of the 2-layer model (widest reduction: the MLP's 128 terms)
    tol = logits_tolerance(torch.float32, width=128, num_layers=2, scale=max(1.0, float(want.abs().max())))
    assert (routed(ids).logits - want).abs().max() <= tol
    os.environ["VERL_CPU_GEMM"] = "torch"
    try:
        with pytest.raises(InputError, match="--linears onednn"):
            load_model(config, 0, "onednn")
    finally:
        del os.environ["VERL_CPU_GEMM"]
