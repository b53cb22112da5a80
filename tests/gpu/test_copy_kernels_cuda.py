"""The CUDA executor against the pure-torch oracle (runs where a GPU and a CUDA build exist)."""

import pytest
import torch

from verl.bench.kernels import CASE_GENERATORS, MB, make_case, reference_copy_program
from verl.ops.copy_program import CopyProgramError, make_program, run_copy_program, validate_program

pytestmark = pytest.mark.gpu


def _cuda_op_available() -> bool:
    if not torch.cuda.is_available():
        return False
    from verl import _C

    return _C.built_with_cuda()


requires_cuda = pytest.mark.skipif(not _cuda_op_available(), reason="no CUDA device or verl._C built without CUDA")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", list(CASE_GENERATORS))
def test_cuda_matches_oracle_on_realistic_programs(kind, dtype):
    case = make_case(kind, 4 * MB)
    src = torch.randn(case.src_numel, device="cuda").to(dtype)
    dst = torch.full((case.dst_numel,), -7.0, device="cuda", dtype=dtype)
    want = reference_copy_program(src, dst.clone(), case.program)
    run_copy_program(src, dst, case.program)
    torch.cuda.synchronize()
    assert torch.equal(dst, want)


@requires_cuda
def test_cuda_unaligned_offsets_use_the_scalar_tail():
    src = torch.randn(10_001, device="cuda").half()
    dst = torch.zeros(10_007, device="cuda").half()
    # In bounds: the first segment reads [3, 7008) and writes [5, 7004); the second reads [7000, 9997)
    # and writes [7005, 10002). Odd offsets and lengths force the scalar path.
    program = make_program([(3, 5, 7, 999, 1001, 1000), (7000, 7005, 1, 2997, 0, 0)])
    validate_program(program, src.numel(), dst.numel(), src.element_size())
    run_copy_program(src, dst, program)
    assert torch.equal(dst, reference_copy_program(src, torch.zeros_like(dst), program))


@requires_cuda
def test_cuda_copy_is_ordered_on_the_current_stream():
    stream = torch.cuda.Stream()
    src = torch.randn(1 << 22, device="cuda")
    dst = torch.zeros_like(src)
    program = make_program([(0, 0, 1, src.numel(), 0, 0)])
    stream.wait_stream(torch.cuda.current_stream())  # src/dst were created on the default stream
    with torch.cuda.stream(stream):
        src.mul_(2.0)  # must finish before the copy reads src: same stream
        run_copy_program(src, dst, program)
    stream.synchronize()
    assert torch.equal(dst, src)


@requires_cuda
@pytest.mark.parametrize(
    "segments, fragment",
    [
        ([(0, 0, 2, 10, 10, 10)], "reads up to element 20"),
        ([(0, 95, 1, 10, 0, 0)], "writes up to element 105"),
        ([(-1, 0, 1, 1, 0, 0)], "every field must be in"),
        ([(0, 0, 3, 4, 4, 2)], "dst_stride < row_elems"),
        ([(0, 0, 1, 8, 0, 0), (0, 7, 1, 2, 0, 0)], "destination ranges overlap"),
    ],
)
def test_cuda_invalid_programs_raise_and_write_nothing(segments, fragment):
    """The GPU build raises the same one-line error as the CPU build (it used to crash the interpreter)."""
    src, dst = torch.randn(15, device="cuda"), torch.full((100,), 7.0, device="cuda")
    with pytest.raises(CopyProgramError, match=fragment.replace("(", r"\(")):
        run_copy_program(src, dst, make_program(segments))
    torch.cuda.synchronize()
    assert torch.all(dst == 7.0)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_cuda_checksum_equals_the_cpu_checksum(dtype):
    from verl.hybrid_engine.weight_sync import checksum

    t = (torch.randn(3_000_001, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    assert checksum(t.cuda()) == checksum(t)
    flipped = t.clone()
    flipped.view(torch.uint8)[12345] ^= 4
    assert checksum(flipped.cuda()) != checksum(t)
