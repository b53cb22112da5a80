"""Copy-kernel microbenchmarks: realistic reshard copy programs vs memcpy and the naive path.

Each case is a copy program of the kind the 3D-HybridEngine planner emits, scaled to a target
size. Every case is timed three ways in the same run:

* ``seconds``        -- ``verl._C`` running the whole program in one call;
* ``memcpy_seconds`` -- ``dst.copy_(src)`` of the same number of bytes (the bandwidth ceiling);
* ``naive_seconds``  -- one ``narrow``/``copy_`` per segment from Python (what a pure-torch
  reshard does), which is also the oracle the tests compare against.

``verl bench kernels --json PATH`` writes one record per case with
``case, bytes, seconds, memcpy_seconds, naive_seconds, ratio_vs_memcpy, speedup_vs_naive``
(``ratio_vs_memcpy`` = memcpy_seconds / seconds, so 1.0 means "as fast as memcpy").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable

import torch

from verl.errors import refuse
from verl.ops.copy_program import make_program, run_copy_program, validate_program
from verl.utils.device import is_cuda_available
from verl.utils.torch_dtypes import DTYPES

MB = 1 << 20


@dataclasses.dataclass
class KernelCase:
    name: str
    src_numel: int
    dst_numel: int
    program: torch.Tensor  # int64 [n, 6]

    @property
    def num_segments(self) -> int:
        return int(self.program.shape[0])

    def copied_elems(self) -> int:
        p = self.program
        return int((p[:, 2] * p[:, 3]).sum()) if len(p) else 0


def reference_copy_program(src: torch.Tensor, dst: torch.Tensor, program: torch.Tensor) -> torch.Tensor:
    """The pure-torch oracle and naive baseline: one strided view + ``copy_`` per segment."""
    for src_offset, dst_offset, rows, row_elems, src_stride, dst_stride in program.tolist():
        if rows == 0 or row_elems == 0:
            continue
        s = src.as_strided((rows, row_elems), (src_stride, 1), src.storage_offset() + src_offset)
        d = dst.as_strided((rows, row_elems), (dst_stride, 1), dst.storage_offset() + dst_offset)
        d.copy_(s)
    return dst


# ---- case generators: each returns (src_numel, dst_numel, segments) for a given element budget ----

def _qkv_regroup(elems: int, heads_per_group: int = 4, groups: int = 8, head_dim: int = 128):
    """Megatron linear_qkv ([q of group; k; v] per query group) -> SGLang's fused QKV ([q; k; v])."""
    rows_per_group = (heads_per_group + 2) * head_dim
    hidden = max(16, elems // (groups * rows_per_group))
    segs = []
    q_rows = heads_per_group * head_dim
    for g in range(groups):
        base = g * rows_per_group * hidden
        segs.append((base, g * q_rows * hidden, 1, q_rows * hidden, 0, 0))
        k_dst = groups * q_rows * hidden
        segs.append((base + q_rows * hidden, k_dst + g * head_dim * hidden, 1, head_dim * hidden, 0, 0))
        v_dst = k_dst + groups * head_dim * hidden
        segs.append((base + (q_rows + head_dim) * hidden, v_dst + g * head_dim * hidden, 1, head_dim * hidden, 0, 0))
    total = groups * rows_per_group * hidden
    return total, total, segs


def _gate_up_split(elems: int, tp: int = 4):
    """All-gathered Megatron fc1 shards [g0; u0; g1; u1; ...] -> one rollout fused gate/up [g; u]."""
    shard = max(16, elems // (2 * tp))
    segs = []
    for r in range(tp):
        segs.append((2 * r * shard, r * shard, 1, shard, 0, 0))
        segs.append(((2 * r + 1) * shard, (tp + r) * shard, 1, shard, 0, 0))
    return 2 * tp * shard, 2 * tp * shard, segs


def _row_parallel_interleave(elems: int, tp: int = 4, hidden: int = 4096):
    """Row-parallel linear_fc2 shards [H, I/t] (gathered back to back) -> the rollout's full [H, I]."""
    cols = max(4, elems // (hidden * tp))
    segs = [(r * hidden * cols, r * cols, hidden, cols, cols, tp * cols) for r in range(tp)]
    return tp * hidden * cols, tp * hidden * cols, segs


def _vocab_padding_shift(elems: int, tp: int = 4, hidden: int = 1024, megatron_pad: int = 128):
    """Vocab-parallel shards padded to 128*t (Megatron) -> one table padded to 64 (SGLang): the
    real rows of each shard move up to close the padding gaps."""
    vocab = max(tp, elems // hidden) - 37  # a vocab that needs padding
    padded_m = -(-vocab // (megatron_pad * tp)) * megatron_pad * tp
    per_rank = padded_m // tp
    padded_s = -(-vocab // 64) * 64
    segs = []
    for r in range(tp):
        real = max(0, min(per_rank, vocab - r * per_rank))
        if real:
            segs.append((r * per_rank * hidden, r * per_rank * hidden, 1, real * hidden, 0, 0))
    return padded_m * hidden, padded_s * hidden, segs


def _per_head_bucket(elems: int, layers: int = 24, heads: int = 32, kv_heads: int = 8, head_dim: int = 32):
    """A bucket of per-head block copies over many layers (>= 1,000 segments): what an unpack
    program looks like when every head moves on its own, e.g. rollout TP > KV heads."""
    rows_per_layer = (heads + 2 * kv_heads) * head_dim
    hidden = max(1, elems // (layers * rows_per_layer))
    segs = []
    layer_elems = rows_per_layer * hidden
    heads_per_group = heads // kv_heads
    for layer in range(layers):
        base = layer * layer_elems
        for h in range(heads):  # per query group [q..; k; v] -> [q; k; v], one head at a time
            g, j = divmod(h, heads_per_group)
            src = base + (g * (heads_per_group + 2) + j) * head_dim * hidden
            segs.append((src, base + h * head_dim * hidden, head_dim, hidden, hidden, hidden))
        for g in range(kv_heads):
            k_src = base + (g * (heads_per_group + 2) + heads_per_group) * head_dim * hidden
            k_dst = base + (heads + g) * head_dim * hidden
            v_dst = base + (heads + kv_heads + g) * head_dim * hidden
            segs.append((k_src, k_dst, head_dim, hidden, hidden, hidden))
            segs.append((k_src + head_dim * hidden, v_dst, head_dim, hidden, hidden, hidden))
    total = layers * layer_elems
    return total, total, segs


def _small_tensors_bucket(elems: int, hidden: int = 1024, heads: int = 16, kv_heads: int = 4, head_dim: int = 128):
    """The tail bucket of a reshard: norms and per-head qkv-bias slices of many layers (thousands
    of segments of a few KB each), where per-call overhead, not bandwidth, decides the time."""
    per_layer = 2 * hidden + (heads + 2 * kv_heads) * head_dim  # two norms + qkv bias
    layers = max(1, elems // per_layer)
    segs = []
    heads_per_group = heads // kv_heads
    for layer in range(layers):
        base = layer * per_layer
        segs.append((base, base, 1, hidden, 0, 0))
        segs.append((base + hidden, base + hidden, 1, hidden, 0, 0))
        bias = base + 2 * hidden
        for h in range(heads):
            g, j = divmod(h, heads_per_group)
            segs.append((bias + (g * (heads_per_group + 2) + j) * head_dim, bias + h * head_dim, 1, head_dim, 0, 0))
        for g in range(kv_heads):
            k_src = bias + (g * (heads_per_group + 2) + heads_per_group) * head_dim
            segs.append((k_src, bias + (heads + g) * head_dim, 1, head_dim, 0, 0))
            segs.append((k_src + head_dim, bias + (heads + kv_heads + g) * head_dim, 1, head_dim, 0, 0))
    return layers * per_layer, layers * per_layer, segs


CASE_GENERATORS: dict[str, Callable[[int], tuple[int, int, list]]] = {
    "qkv_regroup": _qkv_regroup,
    "gate_up_split": _gate_up_split,
    "row_parallel_interleave": _row_parallel_interleave,
    "vocab_padding_shift": _vocab_padding_shift,
    "per_head_bucket": _per_head_bucket,
    "small_tensors_bucket": _small_tensors_bucket,
}
DEFAULT_SIZES_MB = (1, 16, 64, 256)
# The norms and biases of even a 70B model fill ~3 MB, so a bigger "tail bucket" is not a
# program any reshard emits; that case stops at 16 MB.
MAX_SIZE_MB = {"small_tensors_bucket": 16}


def make_case(kind: str, size_bytes: int, elem_size: int = 4) -> KernelCase:
    src_numel, dst_numel, segs = CASE_GENERATORS[kind](size_bytes // elem_size)
    program = make_program(segs)
    validate_program(program, src_numel, dst_numel, elem_size)
    return KernelCase(f"{kind}/{size_bytes // MB}MB", src_numel, dst_numel, program)


def _best_of(fn: Callable[[], object], repeats: int, budget_s: float = 0.25, max_runs: int = 200) -> float:
    """Minimum wall time over at least ``repeats`` runs, continuing (up to ``max_runs``) while the
    runs so far took less than ``budget_s``: small cases get many samples, so one unlucky
    scheduling delay on a shared machine does not become the result."""
    fn()  # warm-up: page faults on fresh buffers are not what we measure
    best, spent, runs = float("inf"), 0.0, 0
    while runs < repeats or (spent < budget_s and runs < max_runs):
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best


def _synchronized(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """On CUDA a call only enqueues work: time it to completion."""
    if device.type != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize(device))


def time_case(case: KernelCase, dtype: torch.dtype = torch.float32, repeats: int = 5,
              device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    src = torch.randn(case.src_numel, device=device).to(dtype)
    dst = torch.zeros(case.dst_numel, dtype=dtype, device=device)
    nbytes = case.copied_elems() * src.element_size()
    flat_src = src[: case.copied_elems()]
    flat_dst = torch.empty_like(flat_src)
    seconds = _best_of(_synchronized(lambda: run_copy_program(src, dst, case.program, validate=False), device),
                       repeats)
    memcpy_seconds = _best_of(_synchronized(lambda: flat_dst.copy_(flat_src), device), repeats)
    naive_dst = torch.zeros_like(dst)
    naive_seconds = _best_of(_synchronized(lambda: reference_copy_program(src, naive_dst, case.program), device),
                             max(1, repeats // 2))
    if not torch.equal(dst, naive_dst):
        raise AssertionError(f"{case.name}: the compiled program and the reference disagree")
    return {
        "case": case.name,
        "dtype": str(dtype).replace("torch.", ""),
        "device": device.type,
        "segments": case.num_segments,
        "bytes": nbytes,
        "seconds": seconds,
        "memcpy_seconds": memcpy_seconds,
        "naive_seconds": naive_seconds,
        "ratio_vs_memcpy": memcpy_seconds / seconds,
        "speedup_vs_naive": naive_seconds / seconds,
    }


def run_all(sizes_mb=DEFAULT_SIZES_MB, kinds=tuple(CASE_GENERATORS), repeats: int = 5, progress=None,
            device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[dict]:
    results = []
    for size in sizes_mb:
        for kind in kinds:
            if size > MAX_SIZE_MB.get(kind, size):
                continue
            case = make_case(kind, size * MB, elem_size=dtype.itemsize)
            results.append(time_case(case, dtype=dtype, repeats=repeats, device=device))
            if progress:
                progress(results[-1])
    return results


def format_table(results: list[dict]) -> str:
    header = (f"{'case':34s} {'segments':>8s} {'MB':>8s} {'ms':>9s} {'memcpy ms':>9s} {'naive ms':>9s} "
              f"{'vs memcpy':>9s} {'vs naive':>9s}")
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['case']:34s} {r['segments']:8d} {r['bytes'] / MB:8.1f} {r['seconds'] * 1e3:9.3f} "
            f"{r['memcpy_seconds'] * 1e3:9.3f} {r['naive_seconds'] * 1e3:9.3f} {r['ratio_vs_memcpy']:9.2f} "
            f"{r['speedup_vs_naive']:9.1f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="verl bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the per-case records to this JSON file")
    parser.add_argument("--sizes-mb", default=",".join(map(str, DEFAULT_SIZES_MB)),
                        help="comma-separated case sizes in MB (default %(default)s)")
    parser.add_argument("--cases", default=",".join(CASE_GENERATORS),
                        help="comma-separated case kinds (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the buffers live (cuda: timed to completion with torch.cuda.synchronize)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not is_cuda_available():
        return refuse("verl bench kernels", "--device cuda: expected a CUDA device, found none")
    try:
        sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    except ValueError:
        return refuse("verl bench kernels", f"--sizes-mb: expected integers like 1,16,64, found {args.sizes_mb!r}")
    if args.repeats < 1:
        return refuse("verl bench kernels", f"--repeats: expected >= 1, found {args.repeats}")
    kinds = [k for k in args.cases.split(",") if k]
    unknown = [k for k in kinds if k not in CASE_GENERATORS]
    if unknown or not sizes or min(sizes) <= 0:
        return refuse("verl bench kernels", f"expected cases from {list(CASE_GENERATORS)} and positive sizes, "
                      f"found cases {kinds}, sizes {sizes}")
    from tqdm import tqdm

    total = sum(1 for s in sizes for k in kinds if s <= MAX_SIZE_MB.get(k, s))
    bar = tqdm(total=total, desc="bench kernels", unit="case", file=sys.stderr)
    results = run_all(sizes, kinds, args.repeats, progress=lambda r: bar.update(1), device=args.device,
                      dtype=DTYPES[args.dtype])
    bar.close()
    print(format_table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {args.json}")
    return 0
