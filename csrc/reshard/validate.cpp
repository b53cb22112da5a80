// Validation of copy programs: everything that could make an executor write out of bounds or
// write a destination byte twice is rejected here, before any byte moves.
#include <algorithm>
#include <sstream>
#include <utility>
#include <vector>

#include "reshard.h"

namespace verl {
namespace reshard {
namespace {

// Offsets are bounded so that element -> byte arithmetic (x * elem_size) cannot overflow int64.
constexpr int64_t kMaxField = int64_t(1) << 52;

std::string describe(int64_t i, const Segment& s) {
  std::ostringstream os;
  os << "segment " << i << " (src_offset=" << s.src_offset << ", dst_offset=" << s.dst_offset
     << ", rows=" << s.rows << ", row_elems=" << s.row_elems << ", src_stride=" << s.src_stride
     << ", dst_stride=" << s.dst_stride << ")";
  return os.str();
}

}  // namespace

std::string validate_program(const Segment* segments, int64_t num_segments, int64_t src_numel,
                             int64_t dst_numel, int64_t elem_size, int64_t alignment_bytes) {
  std::vector<std::pair<int64_t, int64_t>> writes;  // [begin, end) in elements
  for (int64_t i = 0; i < num_segments; ++i) {
    const Segment& s = segments[i];
    const int64_t fields[kSegmentFields] = {s.src_offset, s.dst_offset, s.rows, s.row_elems, s.src_stride, s.dst_stride};
    for (int64_t f : fields) {
      if (f < 0 || f > kMaxField) {
        return describe(i, s) + ": every field must be in [0, 2^52]";
      }
    }
    if (s.rows == 0 || s.row_elems == 0) {
      continue;  // copies nothing
    }
    // rows * stride stays below 2^104 only in theory; bound the product before using it.
    if (s.rows > 1 && (s.src_stride > kMaxField / s.rows || s.dst_stride > kMaxField / s.rows)) {
      return describe(i, s) + ": rows * stride exceeds 2^52 elements";
    }
    const int64_t src_end = s.src_offset + (s.rows - 1) * s.src_stride + s.row_elems;
    const int64_t dst_end = s.dst_offset + (s.rows - 1) * s.dst_stride + s.row_elems;
    if (src_end > src_numel) {
      std::ostringstream os;
      os << describe(i, s) << ": reads up to element " << src_end << " but src has " << src_numel << " elements";
      return os.str();
    }
    if (dst_end > dst_numel) {
      std::ostringstream os;
      os << describe(i, s) << ": writes up to element " << dst_end << " but dst has " << dst_numel << " elements";
      return os.str();
    }
    if (s.rows > 1 && s.dst_stride < s.row_elems) {
      return describe(i, s) + ": dst_stride < row_elems, so its own rows overlap in dst";
    }
    if (alignment_bytes > 0 && !segment_aligned(s, elem_size, alignment_bytes)) {
      std::ostringstream os;
      os << describe(i, s) << ": claimed " << alignment_bytes << "-byte alignment, but a row start or length is not a multiple of it";
      return os.str();
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
      std::ostringstream os;
      os << "destination ranges overlap: elements [" << writes[k - 1].first << ", " << writes[k - 1].second
         << ") and [" << writes[k].first << ", " << writes[k].second << ") are both written";
      return os.str();
    }
  }
  return "";
}

std::vector<int64_t> unit_prefix(const Segment* segments, int64_t num_segments, int64_t elem_size,
                                 int64_t chunk_bytes) {
  std::vector<int64_t> begin(num_segments + 1, 0);
  for (int64_t i = 0; i < num_segments; ++i) {
    begin[i + 1] = begin[i] + segment_units(segments[i], elem_size, chunk_bytes);
  }
  return begin;
}

}  // namespace reshard
}  // namespace verl
