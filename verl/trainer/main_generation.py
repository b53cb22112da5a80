"""`verl generate`: sample continuations of token-id prompts from an HF checkpoint with a rollout engine.

    verl generate --engine native|sglang --model HF_DIR --tp T --input-ids 1,2,3 [--input-ids 4,5 ...]
                  --max-new-tokens K --temperature T --top-p P --n N --json PATH

Writes ``{"output_ids": [[...]], "logprobs": [[...]]}``: one list per sample (``n`` per prompt, in
prompt order), cut at the stop token (kept) or after K tokens. Native: ``--tp`` > 1 runs T local
ranks (subprocesses) joined over gloo through a rendezvous file in a private temporary directory,
so nothing listens on the network. SGLang: one ``SGLangRollout`` (SGLang starts its own T worker
processes), in this process when ``sglang`` is importable, else by re-running this command with
the SGLang environment's python (``VERL_SGLANG_PYTHON``, default ``.venv-sglang/bin/python``).
Inputs are checked before any rank or engine starts; a bad one prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import torch

from verl.errors import InputError, OneLineArgumentParser, refuse
from verl.utils.torch_dtypes import DTYPES

# Set by the launching `verl generate` in each rank it spawns.
RENDEZVOUS_ENV = "VERL_GENERATE_RENDEZVOUS"
OUTPUT_ENV = "VERL_GENERATE_OUTPUT"
RANK_TIMEOUT_S = 300


def engines() -> tuple[str, ...]:
    """The registered rollout engines (verl.engine.rollout.registry), then Megatron's own generator (not a rollout
    engine: routed to verl.engine.megatron.generate)."""
    from verl.engine.rollout.registry import rollout_names

    return (*rollout_names(), "megatron")


class UsageError(InputError):
    """A bad command line or input: reported as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="verl generate", description=__doc__.split("\n\n")[0], error_type=UsageError)
    p.add_argument("--engine", default="native", help=f"rollout engine, one of {', '.join(engines())}")
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1, help="rollout tensor-parallel size (local ranks)")
    p.add_argument("--input-ids", action="append", metavar="ID,ID,...",
                   help="a prompt as comma-separated token ids; repeat for a batch")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt as text (instead of --input-ids; repeat for a batch): prints the decoded responses")
    p.add_argument("--chat", action="store_true",
                   help="with --prompt: each text is one user message through the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's generation_config.json, as transformers' generate: greedy "
                        "unless it sets do_sample)")
    p.add_argument("--top-p", type=float, default=None, help="default: generation_config.json's, else 1.0")
    p.add_argument("--top-k", type=int, default=None, help="default: generation_config.json's, else -1 (off)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-token-ids", default="", metavar="ID,ID,...", help="extra stop tokens")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos_token_id")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--json", metavar="PATH", help="output file (default: print to stdout)")
    return p


def _token_list(text: str, what: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{what}: expected comma-separated integers, found {text!r}") from None
    return ids


def _model_token_ids(model_dir: str, key: str) -> list[int]:
    """``key`` (eos_token_id / pad_token_id) from generation_config.json, else config.json."""
    from verl.models.hf_io import generation_config

    value = generation_config(model_dir).get(key)
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def sampling_defaults(args: argparse.Namespace) -> tuple[float, float, int]:
    """(temperature, top_p, top_k): the flags given, the rest from the model's generation_config.json as
    transformers' ``generate`` reads it: greedy unless it sets ``do_sample``, then its temperature / top_p / top_k
    (transformers' own defaults 1.0 / 1.0 / 50 where it is silent). A real checkpoint run with no flag then answers
    as transformers does; the choice is said on stderr when it came from the file."""
    from verl.models.hf_io import generation_config

    settings = generation_config(args.model)
    sample = bool(settings.get("do_sample", False))
    temperature = args.temperature
    if temperature is None:
        temperature = float(settings.get("temperature") or 1.0) if sample else 0.0
        how = (f"sampling at temperature {temperature:g} (generation_config.json sets do_sample)" if sample else
               "greedy (the model's generation_config.json does not set do_sample)")
        args.sampling_note = f"verl generate: {how}; --temperature overrides"
    top_p = args.top_p
    if top_p is None:
        top_p = float(settings.get("top_p", 1.0)) if sample else 1.0
    top_k = args.top_k
    if top_k is None:
        top_k = settings.get("top_k", 50) if sample else -1
        top_k = -1 if top_k in (None, 0) else int(top_k)  # transformers' 0 is "off", ours is -1
    return temperature, top_p, top_k


def prepare(args: argparse.Namespace):
    """Validate everything a rank would trip over; return (config, input_ids, attention_mask, params, pad)."""
    from verl.engine.rollout.base import SamplingParams, check_prompts
    from verl.hybrid_engine.rollout_layout import check_rollout_tp
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint, eos_token_ids

    if args.engine not in engines():
        raise UsageError(f"--engine: expected one of {', '.join(engines())}, found {args.engine!r}")
    config = ModelConfig.from_pretrained(args.model)
    check_rollout_tp(config, args.tp)
    HFCheckpoint(args.model)
    if not args.input_ids:  # --prompt texts arrive here as --input-ids (verl.trainer.generate_text)
        raise UsageError("expected --input-ids ID,ID,... or --prompt TEXT, found neither")
    prompts = [_token_list(text, f"--input-ids #{i}") for i, text in enumerate(args.input_ids)]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise UsageError(f"--input-ids #{i}: expected at least one token id, found an empty prompt")
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], dtype=torch.int64)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.int64)
    temperature, top_p, top_k = sampling_defaults(args)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                            response_length=args.max_new_tokens, n=args.n, seed=args.seed,
                            stop_token_ids=tuple(_token_list(args.stop_token_ids, "--stop-token-ids")),
                            eos_token_id=eos_token_ids(args.model),
                            ignore_eos=args.ignore_eos)
    check_prompts(input_ids, attention_mask, config.vocab_size, config.max_position_embeddings,
                  params.response_length)
    pad = (_model_token_ids(args.model, "pad_token_id") or [0])[0]
    return config, input_ids, attention_mask, params, pad


def generate_json(args: argparse.Namespace, tp_group=None) -> dict:
    """Run the ``--engine`` engine as the rollout registry opens it on an HF checkpoint: on this rank of an SPMD
    TP group (native; the result is the same on every rank of it), or in this process driving its own ``--tp``
    workers (SGLang)."""
    from verl.engine.rollout.registry import StandaloneSite, rollout_engine
    from verl.launcher.env import launcher_rank

    config, input_ids, attention_mask, params, pad = prepare(args)
    note = getattr(args, "sampling_note", None)
    if note and launcher_rank() == 0:  # said as generation starts, after every input check: bad input is one line
        print(note, file=sys.stderr)
    site = StandaloneSite(config, args.model, args.tp, tp_group, args.dtype, pad, args.seed or 0,
                          max_rows=input_ids.shape[0] * params.n,
                          max_seq_len=input_ids.shape[1] + params.response_length)
    with rollout_engine(args.engine, "--engine").open_standalone(site) as engine:
        return _output_json(engine.generate(input_ids, attention_mask, params))


def _output_json(out) -> dict:
    lengths = out["response_mask"].sum(-1).tolist()
    return {
        "output_ids": [row[:n] for row, n in zip(out["responses"].tolist(), lengths, strict=False)],
        "logprobs": [row[:n] for row, n in zip(out["rollout_log_probs"].tolist(), lengths, strict=False)],
    }


def _write(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    else:
        print(json.dumps(result))


def _run_rank(args: argparse.Namespace) -> int:
    """One spawned rank: join the file rendezvous, generate, rank 0 writes the output."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{os.environ[RENDEZVOUS_ENV]}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    try:
        result = generate_json(args, tp_group=dist.group.WORLD)
        if rank == 0:
            _write(result, os.environ[OUTPUT_ENV])
    finally:
        dist.destroy_process_group()
    return 0


def _run_in_engine_env(args: argparse.Namespace, argv: list[str], package: str) -> int:
    """An engine that lives in its own environment (SGLang, vLLM): its own processes are its TP ranks, so one
    process here drives it, under that environment's python when this one cannot import ``package``."""
    from verl.engine.rollout.registry import rollout_engine
    from verl.utils.engine_env import importable

    config = prepare(args)[0]  # fail here, once, before the engine starts
    check_model = rollout_engine(args.engine, "--engine").check_model
    if check_model is not None:
        check_model(config, args.tp)
    if importable(package):
        _write(generate_json(args), args.json)
        return 0
    from verl.trainer.engine_python import rerun_under_engine_python

    return rerun_under_engine_python(package, argv, f"--engine {args.engine}", UsageError)


def _spawn_ranks(args: argparse.Namespace, argv: list[str]) -> int:
    from verl.launcher.spawn import spawn_local

    with tempfile.TemporaryDirectory(prefix="verl-generate-") as tmp:
        output = args.json or os.path.join(tmp, "output.json")
        env = dict(os.environ)
        env.update({RENDEZVOUS_ENV: os.path.join(tmp, "rendezvous"), OUTPUT_ENV: output, "GLOO_SOCKET_IFNAME": "lo"})
        # spawn_local gives each of the T ranks its share of this host's cores (verl.launcher.threads).
        code = spawn_local(args.tp, [sys.executable, "-m", "verl.trainer.main_generation", *argv], env=env,
                           out=sys.stderr)
        if code == 0 and not args.json:
            with open(output, encoding="utf-8") as fh:
                print(fh.read())
        return code


def _engine_of(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--engine" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--engine="):
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine = _engine_of(argv)
    if engine == "megatron":
        # The Megatron engine is the (slow, exact) parity oracle; it has its own runner.
        from verl.engine.megatron.generate import main as megatron_generate
        from verl.launcher.spawn import without_option

        return megatron_generate(without_option(argv, "--engine"))
    from verl.engine.rollout.registry import rollout_python_env

    try:
        args = build_parser().parse_args(argv)
        package = rollout_python_env(args.engine)
        if package is not None:
            return _run_in_engine_env(args, argv, package)
        if RENDEZVOUS_ENV in os.environ:
            return _run_rank(args)
        if args.tp == 1:
            _write(generate_json(args), args.json)
            return 0
        prepare(args)  # fail here, once, before any rank starts
        return _spawn_ranks(args, argv)
    except InputError as exc:  # UsageError, RolloutInputError, CheckpointError, SGLangConfigError, ...
        return refuse("verl generate", f"error: {exc}")


if __name__ == "__main__":
    # verl's Hydra-key job, --prompt texts, or the token-id command above: verl.trainer.generate_text routes (run as
    # the main module: it imports this one, and an import back would be a circle)
    import runpy

    runpy.run_module("verl.trainer.generate_text", run_name="__main__", alter_sys=True)
