"""``verl convert``: HF safetensors <-> megatron dist checkpoints (any tp, pp).

  hf-to-mcore --hf-dir D --out C --tp T --pp P [--ep E --etp F] [--head lm|value|score]
      spawns T*P local ranks (times the DP replicas expert parallelism needs: E*F ranks per stage); each
      loads its shard from D and the ranks save a model-only dist checkpoint C (loadable at any tp/pp/ep).
      The HF config.json travels in C's manifest.
  mcore-to-hf --ckpt C --out D [--max-shard-bytes N]
      loads C at tp=pp=1 and streams D: config.json + model.safetensors (or shards + index past N bytes).

Bad input is one line on stderr and exit code 2; outputs are written to a staging directory and
renamed, so nothing half-written is left behind.
"""

from __future__ import annotations

import argparse
import os
import sys

from verl.errors import OutputExistsError
from verl.models.config import ModelConfig, ModelConfigError
from verl.models.hf_io import DEFAULT_MAX_SHARD_BYTES, HFCheckpoint, read_config
from verl.models.mcore.model import HEADS, ModelLayoutError, check_parallel_layout
from verl.models.mcore.weights import WeightsError

USAGE_ERROR = 2


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
    check_parallel_layout(config, args.tp, args.pp, args.ep, args.etp, world_size=nproc)
    HFCheckpoint(args.hf_dir)  # every shard present
    _check_out(args.out)
    run_ranks(_hf_to_mcore_rank, nproc, os.path.abspath(args.hf_dir), os.path.abspath(args.out),
              args.tp, args.pp, args.head, hf_config, args.ep, args.etp, timeout_s=600)


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
    # One rank streams the weights into the staging directory and renames it to --out.
    run_ranks(_mcore_to_hf_rank, 1, os.path.abspath(args.ckpt), manifest["head"], manifest["hf_config"],
              os.path.abspath(args.out), args.max_shard_bytes, timeout_s=600)


def main(argv: list[str] | None = None) -> int:
    from verl.engine.megatron.checkpoint import CheckpointError

    args = _parser().parse_args(argv)
    try:
        (hf_to_mcore if args.direction == "hf-to-mcore" else mcore_to_hf)(args)
    except (ModelConfigError, ModelLayoutError, WeightsError, CheckpointError, FileExistsError) as exc:
        print(f"verl convert: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
