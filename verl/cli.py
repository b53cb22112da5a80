"""The `verl` command line.

Each subcommand lives in its own module and exposes ``main(argv) -> int``; this file only
routes to them, importing a module when its command runs (so `verl --help` stays instant and a
command's heavy imports are paid only by that command).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from verl.errors import EXIT_INTERNAL_ERROR, InputError, refuse
from verl.version import __version__

# command -> (module with main(argv), one-line help). Nested groups map a sub-command name too.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("verl.trainer.main_ppo", "RL post-training (PPO, GRPO, RLOO, REINFORCE++) from a YAML config"),
    "sft": ("verl.trainer.main_sft", "supervised fine-tuning on the Megatron engine (the RL warm start)"),
    "eval": ("verl.trainer.evaluate", "greedy held-out accuracy of an HF checkpoint with the native engine"),
    "generate": ("verl.trainer.generate_text",
                 "generate from token-id or text prompts (--prompt, --chat) with the native, sglang or megatron "
                 "engine; verl's Hydra keys run verl's generation job"),
    "convert": ("verl.engine.megatron.convert", "convert weights: hf-to-mcore (any tp/pp) and mcore-to-hf"),
    "plot": ("verl.utils.plotting", "plot reward / accuracy / KL / response length per step from a metrics.jsonl"),
    "check-env": ("verl.utils.env_check",
                  "report what this machine has for verl-hpc (exit 1 if a required part is missing)"),
}
GROUPS: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "bench": ("benchmarks that print ratios against baselines measured in the same run", {
        "kernels": ("verl.bench.kernels", "copy-program kernels vs memcpy and the naive per-segment path"),
        "rollout": ("verl.bench.rollout",
                    "rollout tokens/s: the native engine (and SGLang when installed) on one model"),
        "reshard": ("verl.bench.reshard",
                    "3D-HybridEngine reshard on N local ranks vs memcpy and the naive gather path"),
        "train": ("verl.bench.train", "N GRPO steps of a model config: s/step, phase split, tokens/s, peak RSS"),
        "gemm": ("verl.bench.cpu_gemm", "fp32 GEMM on this CPU: torch's default BLAS vs oneDNN, a model's shapes"),
        "dispatch": ("verl.bench.dispatch",
                     "bytes each rank receives per step: the data plane vs the legacy all-gather, weak scaling"),
    }),
    "data": ("prepare verl-format parquet datasets from local files", {
        "arithmetic": ("verl.utils.dataset.arithmetic", "generate the arithmetic quickstart task and its tokenizer"),
        "gsm8k": ("verl.utils.dataset.gsm8k", "convert a local GSM8K jsonl into verl parquet"),
        "word-problems": ("verl.utils.dataset.word_problems",
                          "generate GSM8K-format word problems (the real-model RL task)"),
        "calculator-problems": ("verl.utils.dataset.calculator_problems",
                                "word problems with large numbers and calculator demonstrations (the agentic task)"),
    }),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl",
        description="verl-hpc: HybridFlow RL post-training on Megatron-core, SGLang and Slurm.",
        epilog="Run `verl COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"verl-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    for name, (help_text, children) in GROUPS.items():
        group = sub.add_parser(name, help=help_text)
        group_sub = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
        for child, (_, child_help) in children.items():
            group_sub.add_parser(child, help=child_help, add_help=False)
    return parser


FULL_ERROR_ENV = "VERL_FULL_ERROR"  # =1: let tracebacks through (as Hydra's HYDRA_FULL_ERROR)
# Input errors derive from verl.errors.InputError (ConfigError, DatasetError, CheckpointError, ...). Anything
# else, a ValueError from inside torch included, is an internal error.
INPUT_ERRORS = (InputError,)


def _one_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.filename}: {err.strerror}"
    return text or type(err).__name__


def _run(module: str, argv: list[str], name: str = "verl") -> int:
    """A subcommand's ``main(argv)``: bad input is one line on stderr and exit 2; an internal error is
    one line naming a file that holds the traceback, exit 1; Ctrl-C exits 130 without a traceback."""
    if os.environ.get(FULL_ERROR_ENV) == "1":
        return int(importlib.import_module(module).main(argv) or 0)
    try:
        return int(importlib.import_module(module).main(argv) or 0)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except INPUT_ERRORS as err:
        return refuse(name, _one_line(err))
    except Exception as err:  # noqa: BLE001 - one line for the user, the traceback in a file
        import tempfile
        import traceback

        fd, path = tempfile.mkstemp(prefix=f"{name.replace(' ', '-')}-", suffix=".traceback")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(traceback.format_exception(err)))
        print(f"{name}: internal error: {type(err).__name__}: {_one_line(err)} (traceback: {path}; "
              f"{FULL_ERROR_ENV}=1 prints it)", file=sys.stderr)
        return EXIT_INTERNAL_ERROR


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv or ["--help"])
        return 0
    command, rest = argv[0], argv[1:]
    if command in COMMANDS:
        return _run(COMMANDS[command][0], rest, f"verl {command}")
    if command in GROUPS:
        children = GROUPS[command][1]
        if rest and rest[0] in children:
            return _run(children[rest[0]][0], rest[1:], f"verl {command} {rest[0]}")
        if not rest or rest[0] in ("-h", "--help"):
            parser.parse_args([command, "--help"])
            return 0
        return refuse(f"verl {command}", f"expected one of {', '.join(children)}, found {rest[0]!r}")
    known = ", ".join(list(COMMANDS) + list(GROUPS))
    return refuse("verl", f"expected a command ({known}), found {command!r}")


def console_main() -> None:
    """The ``verl`` command: :func:`main`, then the process ends without the interpreter's teardown (see
    :func:`verl.launcher.bootstrap.exit_process`; every command has closed what it wrote by then)."""
    from verl.launcher.bootstrap import exit_process

    exit_process(main())


if __name__ == "__main__":
    console_main()
