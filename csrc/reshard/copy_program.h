// Copy programs: the index math shared by the CPU (OpenMP) and CUDA executors.
//
// A copy program is an array of segments. Segment s copies, for r in [0, rows), row_elems
// contiguous elements from src[src_offset + r*src_stride] to dst[dst_offset + r*dst_stride]
// (all counted in elements). Executors work in bytes and split every row into "units" of at
// most `chunk_bytes`, so that one huge row and a million tiny rows both spread over all threads.
//
// This header is the only place the unit -> (segment, row, byte range) mapping lives; both
// executors call these __host__ __device__ functions.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define VERL_HD __host__ __device__ __forceinline__
#else
#define VERL_HD inline
#endif

namespace verl {
namespace reshard {

constexpr int kSegmentFields = 6;

struct Segment {
  int64_t src_offset;
  int64_t dst_offset;
  int64_t rows;
  int64_t row_elems;
  int64_t src_stride;
  int64_t dst_stride;
};
static_assert(sizeof(Segment) == kSegmentFields * sizeof(int64_t), "Segment must match the [n, 6] int64 program layout");

// One unit of work: copy `nbytes` bytes from src+src_byte to dst+dst_byte.
struct UnitCopy {
  int64_t src_byte;
  int64_t dst_byte;
  int64_t nbytes;
};

VERL_HD int64_t chunks_per_row(int64_t row_bytes, int64_t chunk_bytes) {
  return row_bytes <= 0 ? 0 : (row_bytes + chunk_bytes - 1) / chunk_bytes;
}

VERL_HD int64_t segment_units(const Segment& seg, int64_t elem_size, int64_t chunk_bytes) {
  return seg.rows <= 0 ? 0 : seg.rows * chunks_per_row(seg.row_elems * elem_size, chunk_bytes);
}

// unit_begin[i] is the first unit of segment i (exclusive prefix sum, n + 1 entries). Returns the
// segment owning `unit`: the last i with unit_begin[i] <= unit (empty segments are skipped over).
VERL_HD int64_t find_segment(const int64_t* unit_begin, int64_t num_segments, int64_t unit) {
  int64_t lo = 0, hi = num_segments;  // invariant: unit_begin[lo] <= unit < unit_begin[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (unit_begin[mid] <= unit) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The byte range of unit `local_unit` (counted from the segment's first unit).
VERL_HD UnitCopy unit_copy(const Segment& seg, int64_t local_unit, int64_t elem_size, int64_t chunk_bytes) {
  const int64_t row_bytes = seg.row_elems * elem_size;
  const int64_t per_row = chunks_per_row(row_bytes, chunk_bytes);
  const int64_t row = local_unit / per_row;
  const int64_t chunk = local_unit - row * per_row;
  const int64_t start = chunk * chunk_bytes;
  const int64_t remaining = row_bytes - start;
  UnitCopy u;
  u.src_byte = (seg.src_offset + row * seg.src_stride) * elem_size + start;
  u.dst_byte = (seg.dst_offset + row * seg.dst_stride) * elem_size + start;
  u.nbytes = remaining < chunk_bytes ? remaining : chunk_bytes;
  return u;
}

// A segment whose rows are back to back in both buffers is one long row: copying it as such
// turns many short memcpys into few long ones. Executors coalesce before computing units.
VERL_HD Segment coalesce_rows(Segment seg) {
  if (seg.rows > 1 && seg.src_stride == seg.row_elems && seg.dst_stride == seg.row_elems) {
    seg.row_elems *= seg.rows;
    seg.rows = 1;
  }
  return seg;
}

// True when every unit of the segment starts and ends on `align`-byte boundaries (relative to the
// buffer base), given that chunk_bytes is itself a multiple of `align`.
VERL_HD bool segment_aligned(const Segment& seg, int64_t elem_size, int64_t align) {
  return ((seg.src_offset * elem_size) % align) == 0 && ((seg.dst_offset * elem_size) % align) == 0 &&
         ((seg.src_stride * elem_size) % align) == 0 && ((seg.dst_stride * elem_size) % align) == 0 &&
         ((seg.row_elems * elem_size) % align) == 0;
}

}  // namespace reshard
}  // namespace verl
