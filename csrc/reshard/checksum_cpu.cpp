// CPU checksum of a buffer (see checksum.h): an OpenMP sum of the per-element terms.
#ifdef _OPENMP
#include <omp.h>
#endif

#include "checksum.h"
#include "reshard.h"

namespace verl {
namespace reshard {

namespace {

template <typename Word>
uint64_t checksum_words(const void* data, int64_t numel) {
  uint64_t total = 0;
#ifdef _OPENMP
  // Below a few MiB a thread's wake-up costs more than its share (as the copy executor).
  const bool parallel = numel * static_cast<int64_t>(sizeof(Word)) >= 4 * 1024 * 1024 && omp_get_max_threads() > 1;
#pragma omp parallel for reduction(+ : total) schedule(static) if (parallel)
#endif
  for (int64_t i = 0; i < numel; ++i) {
    total += checksum_term(word_at<Word>(data, i), i);
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
