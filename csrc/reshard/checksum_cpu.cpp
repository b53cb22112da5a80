// CPU checksum of a buffer (see checksum.h): an OpenMP sum of the per-element terms.
#ifdef _OPENMP
#include <omp.h>
#endif

#include "checksum.h"
#include "reshard.h"

namespace verl {
namespace reshard {

namespace {

constexpr int64_t kBlock = 4096;  // elements per block: offsets fit 32 bits (checksum_block regroups)

template <typename Word>
uint64_t checksum_words(const void* data, int64_t numel) {
  const Word* words = static_cast<const Word*>(data);
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  uint64_t total = 0;
#ifdef _OPENMP
  // Below a few MiB a thread's wake-up costs more than its share (as the copy executor).
  const bool parallel = numel * static_cast<int64_t>(sizeof(Word)) >= 4 * 1024 * 1024 && omp_get_max_threads() > 1;
#pragma omp parallel for reduction(+ : total) schedule(static) if (parallel)
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t base = b * kBlock;
    const int64_t n = numel - base < kBlock ? numel - base : kBlock;
    const Word* w = words + base;
    uint64_t s0 = 0, s1 = 0;
    for (int64_t j = 0; j < n; ++j) {
      s0 += static_cast<uint64_t>(w[j]);
      s1 += static_cast<uint64_t>(w[j]) * static_cast<uint32_t>(j);
    }
    total += checksum_block(static_cast<uint64_t>(base), s0, s1);
  }
  return total;
}

}  // namespace

uint64_t checksum_cpu(const void* data, int64_t numel, int64_t elem_size) {
  switch (elem_size) {
    case 1:
      return checksum_words<uint8_t>(data, numel);
    case 2:
      return checksum_words<uint16_t>(data, numel);
    case 4:
      return checksum_words<uint32_t>(data, numel);
    default:
      return checksum_words<uint64_t>(data, numel);
  }
}

}  // namespace reshard
}  // namespace verl
