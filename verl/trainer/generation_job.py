"""verl's generation job: ``python -m verl.trainer.main_generation KEY=VALUE ...`` (verl's Hydra keys).

    python -m verl.trainer.main_generation data.path=test.parquet data.prompt_key=prompt data.n_samples=4 \\
        data.output_path=out.parquet data.batch_size=64 model.path=HF_DIR rollout.name=native \\
        rollout.temperature=1.0 rollout.top_p=0.7 rollout.response_length=256 \\
        rollout.tensor_model_parallel_size=2 trainer.nnodes=1 trainer.n_gpus_per_node=2

Reads ``data.path`` (parquet), renders each row's ``data.prompt_key`` (a list of chat messages with the
checkpoint's chat template and the generation prompt, as verl's job; a plain string as it is), generates
``data.n_samples`` responses per prompt and writes the same table plus a ``responses`` column (a list of
``n_samples`` strings per row, decoded without special tokens) to ``data.output_path``: written to a temporary
file beside it and renamed into place, so a failed run leaves nothing. Keys and defaults:
``verl/trainer/config/generation.yaml``.

Ranks: ``trainer.nnodes * trainer.n_gpus_per_node`` local ranks (one node), rollout TP
``rollout.tensor_model_parallel_size``, so ``ranks / TP`` replicas each generate a contiguous share of the
prompts (the native engine; SGLang drives its own TP workers from one process, so there ranks = TP). This
process reads and tokenises the data, checks everything a rank would trip over (one line, exit 2, before any
rank starts), spawns the ranks as ``verl generate`` does (gloo over a file rendezvous in a private temporary
directory; TP 1 with one rank runs in this process), decodes and writes.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from verl.errors import EXIT_INPUT_ERROR, InputError
from verl.trainer.config.loader import (
    HYDRA_IGNORED,
    PACKAGED_CONFIG_DIR,
    ConfigError,
    Rule,
    compose,
    resolve_path,
    rule,
)

CONFIG_NAME = "generation"
RESPONSES_COLUMN = "responses"
IGNORED = {**HYDRA_IGNORED,
           "ray_kwargs": "verl-hpc runs no Ray: the job spawns its ranks itself (verl.launcher)",
           "actor": "the generation job trains nothing (verl keeps the section for backward compatibility)"}
# Set in each spawned rank: the plan file (prompts and settings) and where rank 0 writes the token ids.
PLAN_ENV = "VERL_GENERATION_JOB_PLAN"
RANK_TIMEOUT_S = 600


def _rules() -> dict[str, Rule]:
    from verl.engine.rollout.registry import ROLLOUT_NAME_CHOICES
    from verl.utils.torch_dtypes import DTYPES

    return {
        "trainer.nnodes": rule(ge=1),
        "trainer.n_gpus_per_node": rule(ge=1),
        "data.path": rule(str),
        "data.prompt_key": rule(str),
        "data.n_samples": rule(int, ge=1),
        "data.output_path": rule(str),
        "data.batch_size": rule(int, ge=1),
        "model.path": rule(str),
        "model.external_lib": rule(str, nullable=True),
        "rollout.name": rule(choices=ROLLOUT_NAME_CHOICES),
        "rollout.temperature": rule(ge=0),
        "rollout.top_k": rule(int, ge=-1),
        "rollout.top_p": rule(gt=0, le=1),
        "rollout.prompt_length": rule(int, ge=1),
        "rollout.response_length": rule(int, ge=1),
        "rollout.dtype": rule(choices=tuple(DTYPES)),
        "rollout.tensor_model_parallel_size": rule(int, ge=1),
        "rollout.seed": rule(int, nullable=True),
    }


def is_job_argv(argv: Sequence[str]) -> bool:
    """The command line is verl's Hydra overrides (``key=value``, ``+key=v``, ``~key``), not ``verl generate``'s
    ``--options`` (whose first argument always starts with ``-``)."""
    if not argv:
        return False
    first = argv[0]
    return not first.startswith("-") and ("=" in first or first.startswith("~"))


def load_config(overrides: Sequence[str]) -> dict[str, Any]:
    """generation.yaml <- overrides, each leaf's type and range checked, paths resolved."""
    from verl.engine.rollout.registry import REFUSED_ROLLOUT_NAMES

    cfg, base_dir = compose(PACKAGED_CONFIG_DIR, CONFIG_NAME, None, overrides, _rules(), IGNORED)
    for section, key in (("data", "path"), ("data", "output_path"), ("model", "path")):
        cfg[section][key] = resolve_path(cfg[section][key], base_dir)
    name = cfg["rollout"]["name"]
    if name in REFUSED_ROLLOUT_NAMES:
        raise ConfigError(f"rollout.name: expected native or sglang, found {name!r} ({REFUSED_ROLLOUT_NAMES[name]})")
    if cfg["data"]["trust_remote_code"]:
        raise ConfigError("data.trust_remote_code: expected false (verl-hpc never runs a checkpoint's own code), "
                          "found true")
    return cfg


@dataclasses.dataclass
class Plan:
    """What every rank needs: the tokenised prompts and the settings (JSON, written once for the ranks)."""

    model_path: str
    engine: str
    tp: int
    ranks: int
    dtype: str
    prompts: list[list[int]]
    batch_size: int
    pad_token_id: int
    sampling: dict[str, Any]  # SamplingParams' fields

    @property
    def replicas(self) -> int:
        return self.ranks // self.tp


def read_parquet(path: str, error: type[InputError] = InputError):
    """``data.path``'s table, or ``error`` in one line naming what was found (the generation and eval jobs')."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise error(f"data.path: expected a parquet file, found nothing at {path}")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise error(f"data.path: expected a parquet file, found {path} unreadable ({err})") from None


def _prompt_column(path: str, key: str):
    table = read_parquet(path)
    if key not in table.column_names:
        raise InputError(f"data.prompt_key: expected a column {key!r} in {path}, found columns {table.column_names}")
    if table.num_rows == 0:
        raise InputError(f"data.path: expected at least one row, found none in {path}")
    return table, table.column(key).to_pylist()


def render(prompt: Any, tokenizer: Any, where: str, template_kwargs: dict | None = None) -> str:
    """A prompt as the model reads it: chat messages through the tokenizer's chat template with the generation
    prompt (verl's job), a string as it is. Chat messages without a template are an error (verl's job fails in
    transformers there too): concatenating them would silently ask another question."""
    if isinstance(prompt, str):
        return prompt
    if not (isinstance(prompt, (list, tuple)) and prompt
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
        raise InputError(f"{where}: expected a list of chat messages ({{'role', 'content'}}) or a string, "
                         f"found {type(prompt).__name__} {str(prompt)[:80]!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"{where}: expected a tokenizer with a chat_template for chat messages, found none in the "
                         "model's tokenizer files (give plain string prompts, or a checkpoint with a chat template)")
    return tokenizer.apply_chat_template([dict(m) for m in prompt], add_generation_prompt=True, tokenize=False,
                                         **(template_kwargs or {}))


def load_tokenizer(model_path: str, key: str = "model.path"):
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(model_path, "tokenizer_config.json")):
        raise InputError(f"{key}: expected tokenizer files (tokenizer_config.json) in {model_path}, found none")
    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as err:
        raise InputError(f"{key}: expected a tokenizer transformers can load in {model_path}, found "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def check_output_path(path: str, key: str = "data.output_path") -> None:
    """The output's directory (or its nearest existing ancestor, created at write time) is writable."""
    if os.path.isdir(path):
        raise InputError(f"{key}: expected a file path, found a directory at {path}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{key}: expected a writable directory for {path}, found {parent} not writable")


def prepare(cfg: dict[str, Any]):
    """Everything checked before any rank or engine starts; returns (plan, table, tokenizer)."""
    from verl.engine.rollout.registry import rollout_engine
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint, eos_token_ids, generation_config
    from verl.models.rollout_shapes import check_rollout_tp

    data, model, rollout, trainer = cfg["data"], cfg["model"], cfg["rollout"], cfg["trainer"]
    check_output_path(data["output_path"])
    if model["external_lib"]:
        try:
            importlib.import_module(model["external_lib"])
        except ImportError as err:
            raise ConfigError(f"model.external_lib: expected an importable module, found {err}") from None
    if rollout["temperature"] == 0 and data["n_samples"] != 1:
        raise ConfigError(f"data.n_samples: expected 1 with rollout.temperature=0 (greedy), found {data['n_samples']}")
    tp, ranks = rollout["tensor_model_parallel_size"], trainer["nnodes"] * trainer["n_gpus_per_node"]
    if trainer["nnodes"] != 1:
        raise ConfigError(f"trainer.nnodes: expected 1 (the job spawns its ranks on this node), "
                          f"found {trainer['nnodes']}")
    if ranks % tp:
        raise ConfigError(f"trainer.n_gpus_per_node: expected a multiple of rollout.tensor_model_parallel_size "
                          f"({tp}), found {ranks}")
    engine = rollout_engine(rollout["name"], "rollout.name")
    if engine.capabilities.python_env is not None and ranks != tp:
        raise ConfigError(f"trainer.n_gpus_per_node: expected {tp} (= rollout.tensor_model_parallel_size: SGLang "
                          f"runs one engine over its TP workers), found {ranks}")
    if not os.path.isdir(model["path"]):
        raise InputError(f"model.path: expected an HF directory, found nothing at {model['path']}")
    config = ModelConfig.from_pretrained(model["path"])
    check_rollout_tp(config, tp)
    if engine.check_model is not None:
        engine.check_model(config, tp)
    HFCheckpoint(model["path"])
    from verl.utils.dataset.rl_dataset import encode_prompt

    tokenizer = load_tokenizer(model["path"])
    table, raw = _prompt_column(data["path"], data["prompt_key"])
    prompts = []
    for i, prompt in enumerate(raw):
        where = f"data.path: row {i} of {data['prompt_key']!r}"
        ids = encode_prompt(render(prompt, tokenizer, where, data["apply_chat_template_kwargs"]), tokenizer,
                            templated=not isinstance(prompt, str))
        if not ids:
            raise InputError(f"{where}: expected a prompt of at least one token, found an empty one")
        if len(ids) > rollout["prompt_length"]:
            raise InputError(f"{where}: expected at most rollout.prompt_length={rollout['prompt_length']} tokens, "
                             f"found {len(ids)}")
        prompts.append(ids)
    longest = max(len(p) for p in prompts) + rollout["response_length"]
    if longest > config.max_position_embeddings:
        raise InputError(f"rollout.response_length: expected the longest prompt + response_length <= the model's "
                         f"max_position_embeddings ({config.max_position_embeddings}), found {longest}")
    pad = generation_config(model["path"], tokenizer).get("pad_token_id")
    pad = pad[0] if isinstance(pad, list) else pad
    sampling = dict(temperature=float(rollout["temperature"]), top_p=float(rollout["top_p"]),
                    top_k=int(rollout["top_k"]), response_length=rollout["response_length"], n=data["n_samples"],
                    do_sample=bool(rollout["do_sample"]), eos_token_id=list(eos_token_ids(model["path"], tokenizer)),
                    ignore_eos=bool(rollout["ignore_eos"]), seed=rollout["seed"])
    from verl.engine.rollout.base import SamplingParams

    SamplingParams(**sampling)  # its own checks, here rather than on a rank
    plan = Plan(model_path=model["path"], engine=rollout["name"], tp=tp, ranks=ranks, dtype=rollout["dtype"],
                prompts=prompts, batch_size=data["batch_size"], pad_token_id=0 if pad is None else int(pad),
                sampling=sampling)
    return plan, table, tokenizer


# --------------------------------------------------------------------------- generation (any rank)
def replica_rows(total: int, replicas: int, replica: int) -> range:
    """The contiguous share of ``total`` prompts replica ``replica`` of ``replicas`` generates."""
    per, extra = divmod(total, replicas)
    start = replica * per + min(replica, extra)
    return range(start, start + per + (1 if replica < extra else 0))


def generate_ids(plan: Plan, rows: Sequence[int], tp_group=None) -> list[list[list[int]]]:
    """For each prompt of ``rows``, its ``n`` responses' token ids (cut after the stop token), on this rank's
    engine (the same on every rank of its TP group)."""
    import torch

    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.registry import StandaloneSite, rollout_engine
    from verl.models.config import ModelConfig

    config = ModelConfig.from_pretrained(plan.model_path)
    n = plan.sampling["n"]
    prompts = [plan.prompts[i] for i in rows]
    width = max((len(p) for p in prompts), default=1)
    site = StandaloneSite(config, plan.model_path, plan.tp, tp_group, plan.dtype, plan.pad_token_id,
                          plan.sampling["seed"] or 0, max_rows=min(plan.batch_size, max(len(prompts), 1)) * n,
                          max_seq_len=width + plan.sampling["response_length"])
    out: list[list[list[int]]] = []
    with rollout_engine(plan.engine, "rollout.name").open_standalone(site) as engine:
        for b, start in enumerate(range(0, len(prompts), plan.batch_size)):
            batch = prompts[start:start + plan.batch_size]
            longest = max(len(p) for p in batch)
            input_ids = torch.tensor([[plan.pad_token_id] * (longest - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
            seed = plan.sampling["seed"]
            # Each batch its own stream: one seed for all would give every batch the same draws.
            params = SamplingParams(**{**plan.sampling, "seed": None if seed is None else seed + b})
            result = engine.generate(input_ids, mask, params)
            lengths = result["response_mask"].sum(-1).tolist()
            ids = [row[:k] for row, k in zip(result["responses"].tolist(), lengths, strict=True)]
            out.extend(ids[i * n:(i + 1) * n] for i in range(len(batch)))
    return out


def _run_rank(plan_file: str) -> int:
    """One spawned rank: join the file rendezvous, its replica generates its share, rank 0 gathers and writes."""
    import torch
    import torch.distributed as dist

    from verl.utils.device import dist_backend

    with open(plan_file, encoding="utf-8") as fh:
        spec = json.load(fh)
    plan = Plan(**spec["plan"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = dist_backend(world)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method=f"file://{spec['rendezvous']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    try:
        # Every rank creates every replica's TP group, in the same order (new_group is collective).
        groups = [dist.new_group(list(range(r * plan.tp, (r + 1) * plan.tp))) for r in range(plan.replicas)]
        replica = rank // plan.tp
        ids = generate_ids(plan, replica_rows(len(plan.prompts), plan.replicas, replica),
                           groups[replica] if plan.tp > 1 else None)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, ids if rank % plan.tp == 0 else None)
        if rank == 0:
            merged = [row for part in gathered if part is not None for row in part]
            with open(spec["output"], "w", encoding="utf-8") as fh:
                json.dump(merged, fh)
    finally:
        dist.destroy_process_group()
    return 0


def _spawn(plan: Plan) -> list[list[list[int]]]:
    from verl.launcher.spawn import spawn_local

    with tempfile.TemporaryDirectory(prefix="verl-generation-") as tmp:
        plan_file, output = os.path.join(tmp, "plan.json"), os.path.join(tmp, "ids.json")
        with open(plan_file, "w", encoding="utf-8") as fh:
            json.dump({"plan": dataclasses.asdict(plan), "rendezvous": os.path.join(tmp, "rendezvous"),
                       "output": output}, fh)
        env = dict(os.environ)
        env.update({PLAN_ENV: plan_file, "GLOO_SOCKET_IFNAME": "lo"})
        code = spawn_local(plan.ranks, [sys.executable, "-m", "verl.trainer.generation_job"], env=env,
                           out=sys.stderr)
        if code != 0:
            raise RuntimeError(f"generation ranks failed (exit {code}); their output is above")
        with open(output, encoding="utf-8") as fh:
            return json.load(fh)


# --------------------------------------------------------------------------- the job
def write_responses(table, texts: list[list[str]], path: str) -> None:
    """``table`` plus (or with a new) ``responses`` column, written to a temporary file beside ``path`` and
    renamed into place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.array(texts, type=pa.list_(pa.string()))
    if RESPONSES_COLUMN in table.column_names:
        table = table.set_column(table.column_names.index(RESPONSES_COLUMN), RESPONSES_COLUMN, column)
    else:
        table = table.append_column(RESPONSES_COLUMN, column)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run(cfg: dict[str, Any]) -> str:
    """Generate and write; returns the output path."""
    plan, table, tokenizer = prepare(cfg)
    if plan.ranks == 1:
        ids = generate_ids(plan, range(len(plan.prompts)))
    else:
        ids = _spawn(plan)
    texts = [[tokenizer.decode(r, skip_special_tokens=True) for r in samples] for samples in ids]
    write_responses(table, texts, cfg["data"]["output_path"])
    return cfg["data"]["output_path"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(argv)
        from verl.engine.rollout.registry import rollout_python_env
        from verl.utils.engine_env import importable

        package = rollout_python_env(cfg["rollout"]["name"])
        if package is not None and not importable(package):
            prepare(cfg)  # fail here, once, before the other environment starts
            from verl.trainer.engine_python import rerun_under_engine_python

            return rerun_under_engine_python(package, argv, f"rollout.name={cfg['rollout']['name']}", InputError)
        path = run(cfg)
    except InputError as exc:
        print(f"main_generation: error: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    print(f"main_generation: wrote {path}")
    return 0


if __name__ == "__main__":  # a spawned rank
    if PLAN_ENV not in os.environ:
        sys.exit(main())
    sys.exit(_run_rank(os.environ[PLAN_ENV]))
