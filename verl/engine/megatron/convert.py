"""``verl convert``: HF safetensors <-> megatron dist checkpoints (any tp, pp).

  hf-to-mcore --hf-dir D --out C --tp T --pp P [--ep E --etp F] [--head lm|value|score]
      spawns T*P local ranks (times the DP replicas expert parallelism needs: E*F ranks per stage); each
      loads its shard from D and the ranks save a model-only dist checkpoint C (loadable at any tp/pp/ep).
      The HF config.json travels in C's manifest.
  mcore-to-hf --ckpt C --out D [--max-shard-bytes N]
      loads C at tp=pp=1 and streams D: config.json + model.safetensors (or shards + index past N bytes).

Both take ``--timeout-s`` (default: 600 s plus 1 s per 20 MiB of input, a slow shared file system's pace).
Bad input is one line on stderr and exit code 2. Outputs are written into a private staging directory beside
``--out`` and renamed; on any failure, the time limit included, that directory is removed (a killed 70B
conversion left tens of GB there), so nothing half-written is left behind.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable

from verl.errors import InputError, OutputExistsError
from verl.models.config import ModelConfig, ModelConfigError
from verl.models.hf_io import DEFAULT_MAX_SHARD_BYTES, HFCheckpoint, read_config
from verl.models.mcore.model import HEADS, ModelLayoutError, check_megatron_block, check_parallel_layout
from verl.models.mcore.weights import WeightsError

USAGE_ERROR = 2
MIN_TIMEOUT_S = 600
BYTES_PER_S = 20 << 20  # read + convert + write, on a busy shared file system


def _hf_to_mcore_rank(hf_dir: str, out: str, tp: int, pp: int, head: str, hf_config: dict, ep: int = 1,
                      etp: int | None = None) -> bool:
    from verl.engine.megatron.checkpoint import save_checkpoint
    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.models.mcore.weights import load_hf_into_model

    initialize_megatron(tp, pp, ep_size=ep, etp_size=etp)
    config = ModelConfig.from_dict(hf_config)
    engine = MegatronEngine(config, head)
    checkpoint = HFCheckpoint(hf_dir)
    load_hf_into_model(engine.module, config, checkpoint.get, head, names=checkpoint.files)
    save_checkpoint(engine, out, iteration=0, with_optimizer=False, extra_manifest={"hf_config": hf_config})
    destroy_megatron()
    return True


def _mcore_to_hf_rank(ckpt: str, head: str, hf_config: dict, out: str, max_shard_bytes: int) -> bool:
    from verl.engine.megatron.checkpoint import load_checkpoint
    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.models.hf_export import export_model_hf

    initialize_megatron(1, 1)
    config = ModelConfig.from_dict(hf_config)
    engine = MegatronEngine(config, head)
    load_checkpoint(engine, ckpt, with_optimizer=False)
    export_model_hf(engine.module, config, out, hf_config, head=head, max_shard_bytes=max_shard_bytes,
                    replace=False)
    destroy_megatron()
    return True


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (a file: its size)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def default_timeout_s(input_bytes: int) -> int:
    """The conversion's time limit from its input's size: a fixed 600 s cut off any model past a few GB."""
    return MIN_TIMEOUT_S + math.ceil(input_bytes / BYTES_PER_S)


def _timeout(args, input_path: str) -> float:
    if args.timeout_s is None:
        return default_timeout_s(tree_bytes(input_path))
    if not args.timeout_s > 0:
        raise InputError(f"--timeout-s: expected a positive number of seconds, found {args.timeout_s}")
    return args.timeout_s


def run_staged(out: str, launch: Callable[[str], None], timeout_s: float) -> None:
    """``launch(target)`` (the ranks) writes ``target`` inside a private staging directory beside ``out``; it is
    renamed to ``out`` once complete. On any failure -- a rank's error, the time limit (the ranks are killed, so
    their own cleanup never runs), an interrupt -- the staging directory goes, with whatever it holds."""
    from verl.launcher.spawn import RankFailure

    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f"{os.path.basename(out)}.tmp-convert-", dir=os.path.dirname(out))
    try:
        target = os.path.join(staging, "out")
        try:
            launch(target)
        except RankFailure as err:
            raise RankFailure(f"{err}\nverl convert: nothing was written to {out} (staging removed); the time "
                              f"limit was {timeout_s:.0f} s (--timeout-s)") from None
        _check_out(out)
        os.rename(target, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron dist checkpoint")
    to_mcore.add_argument("--hf-dir", required=True)
    to_mcore.add_argument("--out", required=True)
    to_mcore.add_argument("--tp", type=int, default=1)
    to_mcore.add_argument("--pp", type=int, default=1)
    to_mcore.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
    to_mcore.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    to_mcore.add_argument("--head", choices=HEADS, default="lm")
    to_hf = sub.add_parser("mcore-to-hf", help="megatron dist checkpoint -> HF safetensors")
    to_hf.add_argument("--ckpt", required=True)
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                       help=f"largest safetensors shard (default {DEFAULT_MAX_SHARD_BYTES}); more shards get an index")
    for command in (to_mcore, to_hf):
        command.add_argument("--timeout-s", type=float, default=None,
                             help=f"time limit of the conversion (default {MIN_TIMEOUT_S} s + 1 s per "
                                  f"{BYTES_PER_S >> 20} MiB of input)")
    return parser


def _check_out(out: str) -> None:
    if os.path.exists(out):
        raise OutputExistsError(f"--out: expected a path that does not exist yet, found {out}")


def hf_to_mcore(args) -> None:
    from verl.launcher.spawn import run_ranks

    hf_config = read_config(args.hf_dir)
    config = ModelConfig.from_dict(hf_config)  # validates, with messages that name the key
    from verl.engine.megatron.generate import _default_nproc

    nproc = _default_nproc(args.tp, args.pp, args.ep, args.etp)
    check_megatron_block(config)
    check_parallel_layout(config, args.tp, args.pp, args.ep, args.etp, world_size=nproc)
    HFCheckpoint(args.hf_dir)  # every shard present
    _check_out(args.out)
    timeout_s = _timeout(args, args.hf_dir)
    run_staged(args.out, lambda target: run_ranks(
        _hf_to_mcore_rank, nproc, os.path.abspath(args.hf_dir), target, args.tp, args.pp, args.head, hf_config,
        args.ep, args.etp, timeout_s=timeout_s), timeout_s)


def mcore_to_hf(args) -> None:
    from verl.engine.megatron.checkpoint import read_manifest
    from verl.launcher.spawn import run_ranks

    manifest = read_manifest(args.ckpt)
    if "hf_config" not in manifest:
        raise WeightsError(f"checkpoint {args.ckpt}: expected an 'hf_config' in its manifest "
                           f"(written by hf-to-mcore), found none")
    _check_out(args.out)
    if args.max_shard_bytes <= 0:
        raise WeightsError(f"--max-shard-bytes: expected a positive size, found {args.max_shard_bytes}")
    timeout_s = _timeout(args, args.ckpt)
    # One rank streams the weights into the staging directory; the directory is renamed to --out.
    run_staged(args.out, lambda target: run_ranks(
        _mcore_to_hf_rank, 1, os.path.abspath(args.ckpt), manifest["head"], manifest["hf_config"], target,
        args.max_shard_bytes, timeout_s=timeout_s), timeout_s)


def main(argv: list[str] | None = None) -> int:
    from verl.engine.megatron.checkpoint import CheckpointError

    args = _parser().parse_args(argv)
    try:
        (hf_to_mcore if args.direction == "hf-to-mcore" else mcore_to_hf)(args)
    except (ModelConfigError, ModelLayoutError, WeightsError, CheckpointError, FileExistsError, InputError) as exc:
        print(f"verl convert: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
