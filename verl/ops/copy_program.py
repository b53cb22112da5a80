"""Copy programs: many strided block copies between two flat buffers in one compiled call.

A copy program is an int64 tensor of shape ``[num_segments, 6]``; each row is one segment

    (src_offset, dst_offset, rows, row_elems, src_stride, dst_stride)

all counted in *elements* of the buffers' dtype. Segment ``s`` copies, for ``r in range(rows)``,
``row_elems`` contiguous elements from ``src[src_offset + r*src_stride :]`` to
``dst[dst_offset + r*dst_stride :]``. Every layout difference between Megatron's training shards
and SGLang's rollout shards (QKV regrouping, gate/up split, row-parallel input-dim interleave,
vocab-padding shifts) is a set of such segments; the 3D-HybridEngine planner emits them.

``src`` and ``dst`` are contiguous 1-D tensors of the same element size (fp32/bf16/fp16/...; the
kernels move bytes). Programs are validated before they run: every read and write in bounds, no
two destination rows overlapping, source and destination buffers disjoint. A bad program raises
:class:`CopyProgramError` and writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

SEGMENT_FIELDS = ("src_offset", "dst_offset", "rows", "row_elems", "src_stride", "dst_stride")


class CopyProgramError(ValueError):
    """A copy program that would read or write outside its buffers, or overlap its writes."""


def _ext():
    try:
        import verl._C as _C
    except ImportError as exc:  # pragma: no cover - exercised only on broken installs
        raise ImportError(
            "verl._C (the compiled reshard extension) is not built; run "
            "`pip install --no-build-isolation -e .` in the repository root"
        ) from exc
    return _C


def make_program(segments: Iterable[Sequence[int]]) -> torch.Tensor:
    """Build a program tensor from an iterable of 6-tuples (see :data:`SEGMENT_FIELDS`)."""
    rows = [tuple(int(v) for v in seg) for seg in segments]
    for seg in rows:
        if len(seg) != 6:
            raise CopyProgramError(f"a segment has 6 fields {SEGMENT_FIELDS}, found {len(seg)}: {seg}")
    if not rows:
        return torch.empty((0, 6), dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64)


def _check_tensors(src: torch.Tensor, dst: torch.Tensor, program: torch.Tensor) -> None:
    if program.dtype != torch.int64 or program.dim() != 2 or program.shape[1] != 6:
        raise CopyProgramError(
            f"program must be an int64 tensor of shape [n, 6], found {program.dtype} {tuple(program.shape)}"
        )
    if program.device.type != "cpu":
        raise CopyProgramError(f"program must live on the CPU (it is validated there), found {program.device}")
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 1 or not t.is_contiguous():
            raise CopyProgramError(f"{name} must be a contiguous 1-D tensor, found shape {tuple(t.shape)}")
    if src.element_size() != dst.element_size():
        raise CopyProgramError(
            f"src and dst must have the same element size, found {src.dtype} and {dst.dtype}"
        )
    if src.device != dst.device:
        raise CopyProgramError(f"src and dst must be on one device, found {src.device} and {dst.device}")


def validate_program(
    program: torch.Tensor, src_numel: int, dst_numel: int, elem_size: int = 1, alignment_bytes: int = 0
) -> None:
    """Raise :class:`CopyProgramError` unless ``program`` is safe on buffers of these sizes.

    ``alignment_bytes > 0`` additionally checks a claim that every row start and row length is a
    multiple of that many bytes (for elements of ``elem_size`` bytes), e.g. the planner's promise
    that its buckets allow 16-byte vector copies.
    """
    if program.dtype != torch.int64 or program.dim() != 2 or program.shape[1] != 6:
        raise CopyProgramError(
            f"program must be an int64 tensor of shape [n, 6], found {program.dtype} {tuple(program.shape)}"
        )
    try:
        _ext().validate_copy_program(
            program.contiguous(), int(src_numel), int(dst_numel), int(elem_size), int(alignment_bytes)
        )
    except ValueError as err:  # raised by the extension (TORCH_CHECK_VALUE): one line naming the segment
        raise CopyProgramError(str(err).splitlines()[0]) from None


def run_copy_program(
    src: torch.Tensor, dst: torch.Tensor, program: torch.Tensor, validate: bool = True
) -> torch.Tensor:
    """Execute ``program`` from ``src`` into ``dst`` (in place) and return ``dst``.

    On CUDA tensors the copy is enqueued on the current stream. ``validate=False`` skips the
    checks for a program already validated against buffers of the same sizes (the hybrid engine
    validates each bound program once at start-up).
    """
    _check_tensors(src, dst, program)
    program = program.contiguous()
    if validate:
        validate_program(program, src.numel(), dst.numel(), src.element_size())
        if src.numel() and dst.numel() and src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
            s0, s1 = src.data_ptr(), src.data_ptr() + src.numel() * src.element_size()
            d0, d1 = dst.data_ptr(), dst.data_ptr() + dst.numel() * dst.element_size()
            if s0 < d1 and d0 < s1:
                raise CopyProgramError("src and dst overlap in memory; a copy program needs disjoint buffers")
    if program.shape[0]:
        _ext().run_copy_program(src, dst, program)
    return dst
