// CPU executor of copy programs: units (row chunks, see copy_program.h) are split into one
// contiguous range per OpenMP thread; each thread locates its first segment once by binary search
// and then walks forward, so per-unit overhead is a memcpy call and a few integer ops.
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "reshard.h"

namespace verl {
namespace reshard {
namespace {

// One thread per this many bytes copied: below it, waking a thread (and, on a busy node,
// waiting for it to be scheduled) costs more than the copy it would take over.
constexpr int64_t kBytesPerThread = 4 * 1024 * 1024;

void run_units(const char* src, char* dst, const Segment* segments, const int64_t* unit_begin,
               int64_t num_segments, int64_t elem_size, int64_t first, int64_t last) {
  if (first >= last) {
    return;
  }
  int64_t seg = find_segment(unit_begin, num_segments, first);
  for (int64_t unit = first; unit < last; ++unit) {
    while (unit >= unit_begin[seg + 1]) {
      ++seg;
    }
    const UnitCopy u = unit_copy(segments[seg], unit - unit_begin[seg], elem_size, kCpuChunkBytes);
    std::memcpy(dst + u.dst_byte, src + u.src_byte, static_cast<size_t>(u.nbytes));
  }
}

}  // namespace

int cpu_num_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void run_program_cpu(const void* src, void* dst, const Segment* program, int64_t num_segments,
                     int64_t elem_size) {
  if (num_segments == 0) {
    return;
  }
  std::vector<Segment> coalesced(program, program + num_segments);
  for (Segment& seg : coalesced) {
    seg = coalesce_rows(seg);
  }
  const Segment* segments = coalesced.data();
  std::vector<int64_t> unit_begin(num_segments + 1);
  unit_prefix(segments, num_segments, elem_size, kCpuChunkBytes, unit_begin.data());
  const int64_t total_units = unit_begin[num_segments];
  int64_t total_bytes = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    total_bytes += segments[i].rows * segments[i].row_elems * elem_size;
  }
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
#ifdef _OPENMP
  const int64_t wanted = total_bytes / kBytesPerThread;
  const int threads = static_cast<int>(wanted < omp_get_max_threads() ? wanted : omp_get_max_threads());
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t nt = omp_get_num_threads();
      const int64_t t = omp_get_thread_num();
      // Equal unit counts per thread; units are at most kCpuChunkBytes, so bytes balance too
      // except for programs mixing huge and tiny rows.
      const int64_t first = total_units * t / nt;
      const int64_t last = total_units * (t + 1) / nt;
      run_units(s, d, segments, unit_begin.data(), num_segments, elem_size, first, last);
    }
    return;
  }
#endif
  run_units(s, d, segments, unit_begin.data(), num_segments, elem_size, 0, total_units);
}

}  // namespace reshard
}  // namespace verl
