"""Copy-kernel microbenchmarks (pytest-benchmark), as users run them:

    pytest tests/kernels/test_bench_copy.py --benchmark-columns=min,mean,rounds
    VERL_BENCH_SIZES_MB=1,16,64,256 pytest tests/kernels/test_bench_copy.py

Each case benchmarks the compiled op and records, from the same run, the memcpy and naive
(per-segment torch) times and their ratios in ``extra_info``. Results are checked against the
oracle; speed is reported, never asserted (see `verl bench kernels` for the table).
"""

import os

import pytest
import torch

from verl.bench.kernels import CASE_GENERATORS, MAX_SIZE_MB, MB, make_case, reference_copy_program, time_case
from verl.ops.copy_program import run_copy_program

SIZES_MB = [int(s) for s in os.environ.get("VERL_BENCH_SIZES_MB", "1,16").split(",")]
CASES = [(k, s) for s in SIZES_MB for k in CASE_GENERATORS if s <= MAX_SIZE_MB.get(k, s)]


@pytest.mark.parametrize("kind,size_mb", CASES, ids=[f"{k}-{s}MB" for k, s in CASES])
def test_copy_program_bench(benchmark, kind, size_mb):
    case = make_case(kind, size_mb * MB)
    src = torch.randn(case.src_numel)
    dst = torch.zeros(case.dst_numel)
    benchmark.group = f"copy_program-{size_mb}MB"
    benchmark(run_copy_program, src, dst, case.program, False)
    assert torch.equal(dst, reference_copy_program(src, torch.zeros(case.dst_numel), case.program))
    record = time_case(case, repeats=3)
    benchmark.extra_info.update({k: record[k] for k in ("segments", "bytes", "memcpy_seconds", "naive_seconds",
                                                         "ratio_vs_memcpy", "speedup_vs_naive")})
