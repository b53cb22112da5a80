"""fp32 GEMM on this CPU: torch's default path against oneDNN's, same shapes, same threads (``verl bench gemm``).

torch's ``F.linear`` / ``mm`` on CPU in fp32 calls the BLAS it was built with (MKL in the PyPI wheels). vLLM's CPU
backend calls oneDNN instead, with the weight reordered once into oneDNN's layout (``torch._C._nn.mkldnn_linear`` on
a ``to_mkldnn`` weight does the same from torch). This bench times both on the linear shapes of a model's rollout
(decode: rows x hidden; prefill and the update: tokens x hidden) and the roofline's square matmul, and reports
GFLOP/s, the ratio, and the largest difference of oneDNN's result from torch's relative to the output's scale
(another summation order: a few fp32 ulps of the reduction length).

The oneDNN timing includes converting the input to oneDNN's layout and the result back (what a caller pays); the
weight's reorder is done once, outside the timing (a rollout would do it once per weight update).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from verl.errors import InputError, OneLineArgumentParser, refuse

# (label, M, K, N): SmolLM2-135M's linears (hidden 576, q/k/v 960 rows fused, MLP 1536, vocab 49152) at a GRPO
# step's sizes (32 rows decoding; 8 prompts x ~100 tokens prefilled; 32 x 132 tokens through the update), and the
# roofline's square matmul
SHAPES = (("decode qkv", 32, 576, 960), ("decode gate_up", 32, 576, 3072), ("decode down", 32, 1536, 576),
          ("decode output head", 32, 576, 49152), ("prefill gate_up", 800, 576, 3072),
          ("update gate_up", 4224, 576, 3072), ("update down", 4224, 1536, 576), ("square 1024", 1024, 1024, 1024))


def _seconds(fn, repeats: int) -> float:
    fn()  # warm-up (oneDNN builds its primitive on the first call)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(shapes=SHAPES, threads: int = 2, repeats: int = 20, seed: int = 0) -> list[dict[str, Any]]:
    """One record per shape: both paths' median seconds and GFLOP/s, oneDNN / torch speed, relative difference."""
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("verl bench gemm: this torch build has no oneDNN (torch.backends.mkldnn)")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(seed)
    out = []
    try:
        for label, m, k, n in shapes:
            x = torch.randn(m, k, generator=generator)
            w = torch.randn(n, k, generator=generator) / k ** 0.5
            packed = w.to_mkldnn()

            def onednn(x=x, packed=packed):
                return torch._C._nn.mkldnn_linear(x.to_mkldnn(), packed).to_dense()

            base = _seconds(lambda x=x, w=w: F.linear(x, w), repeats)
            fast = _seconds(onednn, repeats)
            want, got = F.linear(x, w), onednn()
            flops = 2.0 * m * k * n
            out.append({"label": label, "m": m, "k": k, "n": n, "torch_s": base, "onednn_s": fast,
                        "torch_gflops": flops / base / 1e9, "onednn_gflops": flops / fast / 1e9,
                        "speedup": base / fast,
                        "max_rel_diff": float((got - want).abs().max() / want.abs().max())})
    finally:
        torch.set_num_threads(before)
    return out


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(prog="verl bench gemm", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="also write the records here")
    try:
        args = p.parse_args(argv)
        if args.threads < 1 or args.repeats < 1:
            raise InputError(f"--threads and --repeats: expected >= 1, found {args.threads} and {args.repeats}")
    except InputError as err:
        return refuse("verl bench gemm", err)
    records = measure(threads=args.threads, repeats=args.repeats)
    print(f"fp32 GEMM, {args.threads} threads, median of {args.repeats} ({torch.__version__}, "
          f"torch's BLAS: {'MKL' if torch.backends.mkl.is_available() else 'not MKL'})")
    for r in records:
        print(f"{r['label']:16s} {r['m']:5d} x {r['k']:5d} x {r['n']:5d}: torch {r['torch_gflops']:6.1f} GFLOP/s, "
              f"oneDNN {r['onednn_gflops']:6.1f} GFLOP/s, {r['speedup']:.2f}x, max rel diff {r['max_rel_diff']:.1e}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
                       "records": records}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
