"""Property tests of the compiled copy-program op against the pure-torch oracle.

Random valid programs over random buffers, three dtypes, unaligned offsets, empty programs:
every destination element equals the oracle's and bytes outside the program stay poisoned.
Invalid programs raise CopyProgramError and leave the destination untouched.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl.bench.kernels import reference_copy_program
from verl.ops.copy_program import CopyProgramError, make_program, run_copy_program, validate_program

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
POISON = -12345.0  # exactly representable in all three dtypes


@st.composite
def programs(draw, max_segments=24):
    """A valid program: destination rows carved out of disjoint, randomly gapped slots."""
    src_numel = draw(st.integers(1, 4000))
    segs, cursor = [], 0
    for _ in range(draw(st.integers(0, max_segments))):
        rows = draw(st.integers(0, 6))
        row_elems = draw(st.integers(0, 70))
        dst_stride = row_elems + draw(st.integers(0, 5))
        src_stride = draw(st.integers(0, 2 * row_elems + 3))
        dst_offset = cursor + draw(st.integers(0, 9))  # odd gaps: unaligned starts
        span = (rows - 1) * src_stride + row_elems if rows and row_elems else 0
        if span > src_numel:
            continue
        src_offset = draw(st.integers(0, src_numel - span))
        segs.append((src_offset, dst_offset, rows, row_elems, src_stride, dst_stride))
        if rows and row_elems:
            cursor = dst_offset + (rows - 1) * dst_stride + row_elems
    order = draw(st.permutations(range(len(segs))))
    dst_numel = cursor + draw(st.integers(0, 16))
    return src_numel, dst_numel, [segs[i] for i in order]


@settings(max_examples=150, deadline=None)
@given(case=programs(), dtype=st.sampled_from(DTYPES))
def test_random_programs_match_oracle_and_leave_other_bytes_untouched(case, dtype):
    src_numel, dst_numel, segs = case
    program = make_program(segs)
    src = torch.randn(src_numel).to(dtype)
    dst = torch.full((dst_numel,), POISON, dtype=dtype)
    want = reference_copy_program(src, dst.clone(), program)
    run_copy_program(src, dst, program)
    assert torch.equal(dst.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_rows_spanning_several_cpu_chunks_and_threads():
    # 1.5 MiB rows cross the 256 KiB unit boundary; total size takes the OpenMP path.
    n = 3 * 400_000
    src = torch.randn(n)
    dst = torch.full((n + 10,), POISON)
    program = make_program([(0, 10, 2, 400_000, 800_000, 500_000), (800_000, 900_010, 1, 300_000, 0, 0)])
    run_copy_program(src, dst, program)
    assert torch.equal(dst, reference_copy_program(src, torch.full((n + 10,), POISON), program))


def test_empty_program_writes_nothing():
    dst = torch.full((8,), POISON)
    run_copy_program(torch.randn(4), dst, make_program([]))
    assert torch.all(dst == POISON)


@pytest.mark.parametrize(
    "segment, fragment",
    [
        ((0, 0, 2, 10, 10, 10), "reads up to element 20"),
        ((0, 95, 1, 10, 0, 0), "writes up to element 105"),
        ((-1, 0, 1, 1, 0, 0), "every field must be in"),
        ((0, 0, 3, 4, 4, 2), "dst_stride < row_elems"),
    ],
)
def test_invalid_programs_raise_and_write_nothing(segment, fragment):
    src, dst = torch.randn(15), torch.full((100,), POISON)
    with pytest.raises(CopyProgramError, match=fragment.replace("(", r"\(")):
        run_copy_program(src, dst, make_program([segment]))
    assert torch.all(dst == POISON)


def test_overlapping_destination_segments_raise():
    with pytest.raises(CopyProgramError, match="destination ranges overlap"):
        run_copy_program(torch.randn(50), torch.zeros(50), make_program([(0, 0, 1, 8, 0, 0), (0, 7, 1, 2, 0, 0)]))


def test_alignment_claims_are_checked():
    program = make_program([(1, 0, 1, 4, 0, 0)])
    validate_program(program, 100, 100, elem_size=4)  # fine without a claim
    with pytest.raises(CopyProgramError, match="claimed 16-byte alignment"):
        validate_program(program, 100, 100, elem_size=4, alignment_bytes=16)


@pytest.mark.parametrize(
    "src, dst, program, fragment",
    [
        (torch.randn(4), torch.zeros(4, dtype=torch.float16), make_program([]), "same element size"),
        (torch.randn(2, 2), torch.zeros(4), make_program([]), "contiguous 1-D"),
        (torch.randn(4), torch.zeros(4), torch.zeros((1, 5), dtype=torch.int64), r"shape \[n, 6\]"),
        (torch.randn(4), torch.zeros(4), torch.zeros((1, 6), dtype=torch.int32), "int64"),
    ],
)
def test_bad_arguments_raise_one_clear_error(src, dst, program, fragment):
    with pytest.raises(CopyProgramError, match=fragment):
        run_copy_program(src, dst, program)


def test_src_and_dst_views_of_one_buffer_must_not_overlap():
    buf = torch.randn(100)
    with pytest.raises(CopyProgramError, match="overlap in memory"):
        run_copy_program(buf[:60], buf[40:], make_program([(0, 0, 1, 4, 0, 0)]))
    run_copy_program(buf[:50], buf[50:], make_program([(0, 0, 1, 4, 0, 0)]))
    assert torch.equal(buf[50:54], buf[:4])


def test_make_program_rejects_wrong_arity():
    with pytest.raises(CopyProgramError, match="6 fields"):
        make_program([(1, 2, 3)])


def test_extension_raises_value_error_with_one_line_not_a_crash():
    """The binding raises (TORCH_CHECK_VALUE) rather than returning a C++ string across the boundary."""
    from verl import _C

    with pytest.raises(ValueError, match="writes up to element 105") as info:
        _C.validate_copy_program(make_program([(0, 95, 1, 10, 0, 0)]), 100, 100, 4, 0)
    assert str(info.value).splitlines()[0].startswith("segment 0 (src_offset=0, dst_offset=95")
    assert _C.validate_copy_program(make_program([(0, 0, 1, 10, 0, 0)]), 100, 100, 4, 0) is None
