// Validation of copy programs: everything that could make an executor write out of bounds or
// write a destination byte twice is rejected here, before any byte moves.
#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <utility>
#include <vector>

#include "reshard.h"

namespace verl {
namespace reshard {
namespace {

// Offsets are bounded so that element -> byte arithmetic (x * elem_size) cannot overflow int64.
constexpr int64_t kMaxField = int64_t(1) << 52;

// "segment i (fields...): <what>" into message; always returns false (the program is rejected).
bool reject(char* message, int64_t capacity, int64_t i, const Segment& s, const char* format, ...) {
  if (message == nullptr || capacity <= 0) {
    return false;
  }
  int n = std::snprintf(message, static_cast<size_t>(capacity),
                        "segment %" PRId64 " (src_offset=%" PRId64 ", dst_offset=%" PRId64 ", rows=%" PRId64
                        ", row_elems=%" PRId64 ", src_stride=%" PRId64 ", dst_stride=%" PRId64 "): ",
                        i, s.src_offset, s.dst_offset, s.rows, s.row_elems, s.src_stride, s.dst_stride);
  if (n >= 0 && n < capacity) {
    va_list args;
    va_start(args, format);
    std::vsnprintf(message + n, static_cast<size_t>(capacity - n), format, args);
    va_end(args);
  }
  return false;
}

}  // namespace

bool validate_program(const Segment* segments, int64_t num_segments, int64_t src_numel, int64_t dst_numel,
                      int64_t elem_size, int64_t alignment_bytes, char* message, int64_t capacity) {
  if (message != nullptr && capacity > 0) {
    message[0] = '\0';
  }
  std::vector<std::pair<int64_t, int64_t>> writes;  // [begin, end) in elements
  for (int64_t i = 0; i < num_segments; ++i) {
    const Segment& s = segments[i];
    const int64_t fields[kSegmentFields] = {s.src_offset, s.dst_offset, s.rows, s.row_elems, s.src_stride, s.dst_stride};
    for (int64_t f : fields) {
      if (f < 0 || f > kMaxField) {
        return reject(message, capacity, i, s, "every field must be in [0, 2^52]");
      }
    }
    if (s.rows == 0 || s.row_elems == 0) {
      continue;  // copies nothing
    }
    // rows * stride stays below 2^104 only in theory; bound the product before using it.
    if (s.rows > 1 && (s.src_stride > kMaxField / s.rows || s.dst_stride > kMaxField / s.rows)) {
      return reject(message, capacity, i, s, "rows * stride exceeds 2^52 elements");
    }
    const int64_t src_end = s.src_offset + (s.rows - 1) * s.src_stride + s.row_elems;
    const int64_t dst_end = s.dst_offset + (s.rows - 1) * s.dst_stride + s.row_elems;
    if (src_end > src_numel) {
      return reject(message, capacity, i, s, "reads up to element %" PRId64 " but src has %" PRId64 " elements",
                    src_end, src_numel);
    }
    if (dst_end > dst_numel) {
      return reject(message, capacity, i, s, "writes up to element %" PRId64 " but dst has %" PRId64 " elements",
                    dst_end, dst_numel);
    }
    if (s.rows > 1 && s.dst_stride < s.row_elems) {
      return reject(message, capacity, i, s, "dst_stride < row_elems, so its own rows overlap in dst");
    }
    if (alignment_bytes > 0 && !segment_aligned(s, elem_size, alignment_bytes)) {
      return reject(message, capacity, i, s,
                    "claimed %" PRId64 "-byte alignment, but a row start or length is not a multiple of it",
                    alignment_bytes);
    }
    if (s.rows == 1 || s.dst_stride == s.row_elems) {
      writes.emplace_back(s.dst_offset, dst_end);  // one contiguous range
    } else {
      for (int64_t r = 0; r < s.rows; ++r) {
        const int64_t b = s.dst_offset + r * s.dst_stride;
        writes.emplace_back(b, b + s.row_elems);
      }
    }
  }
  std::sort(writes.begin(), writes.end());
  for (size_t k = 1; k < writes.size(); ++k) {
    if (writes[k].first < writes[k - 1].second) {
      if (message != nullptr && capacity > 0) {
        std::snprintf(message, static_cast<size_t>(capacity),
                      "destination ranges overlap: elements [%" PRId64 ", %" PRId64 ") and [%" PRId64 ", %" PRId64
                      ") are both written",
                      writes[k - 1].first, writes[k - 1].second, writes[k].first, writes[k].second);
      }
      return false;
    }
  }
  return true;
}

void unit_prefix(const Segment* segments, int64_t num_segments, int64_t elem_size, int64_t chunk_bytes,
                 int64_t* out) {
  out[0] = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    out[i + 1] = out[i] + segment_units(segments[i], elem_size, chunk_bytes);
  }
}

}  // namespace reshard
}  // namespace verl
