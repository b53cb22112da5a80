// CPU checksum of a buffer (see checksum.h): block sums over OpenMP threads, vectorised per block.
//
// The sync checksums every byte it moves twice (sender and receiver), so this pass must run near memory
// bandwidth. Each block of kBlock elements contributes checksum_block(base, S0, S1); the inner loops keep S0 and
// S1 in the narrowest integers that hold them exactly, so they vectorise wide, and the same loop is compiled for
// AVX-512 and AVX2 besides the baseline, chosen once at run time (the wheel and the extension build with the
// baseline ISA only).
#ifdef _OPENMP
#include <omp.h>
#endif

#include "checksum.h"
#include "reshard.h"

namespace verl {
namespace reshard {

namespace {

constexpr int64_t kBlock = 4096;          // elements per block: offsets within it fit 32 bits
constexpr int64_t kNarrowBlock = 256;     // 1- and 2-byte words: S1 <= 65535 * (0 + ... + 255) < 2^32
constexpr int64_t kBlocksPerTask = 64;    // blocks one OpenMP task sums (1/2 MiB of 2-byte words)

#if defined(__GNUC__)
#define VERL_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define VERL_ALWAYS_INLINE inline
#endif

// Sum of the block terms of blocks [first, last) (kBlock elements each, the last one possibly short). Words of 1
// or 2 bytes go in sub-blocks of kNarrowBlock with 32-bit sums (exact: see kNarrowBlock); wider words in 64-bit
// sums (S1 is then taken mod 2^64, as the definition is).
template <typename Word>
VERL_ALWAYS_INLINE uint64_t block_sums(const Word* words, int64_t numel, int64_t first, int64_t last) {
  uint64_t total = 0;
  const int64_t end = last * kBlock < numel ? last * kBlock : numel;
  int64_t base = first * kBlock;
  if constexpr (sizeof(Word) <= 2) {
    for (; base + kNarrowBlock <= end; base += kNarrowBlock) {
      const Word* w = words + base;
      uint32_t s0 = 0, s1 = 0;
      for (uint32_t j = 0; j < static_cast<uint32_t>(kNarrowBlock); ++j) {
        s0 += static_cast<uint32_t>(w[j]);
        s1 += static_cast<uint32_t>(w[j]) * j;
      }
      total += checksum_block(static_cast<uint64_t>(base), s0, s1);
    }
  } else {
    for (; base + kBlock <= end; base += kBlock) {
      const Word* w = words + base;
      uint64_t s0 = 0, s1 = 0;
      for (uint32_t j = 0; j < static_cast<uint32_t>(kBlock); ++j) {
        s0 += static_cast<uint64_t>(w[j]);
        s1 += static_cast<uint64_t>(w[j]) * j;
      }
      total += checksum_block(static_cast<uint64_t>(base), s0, s1);
    }
  }
  for (; base < end; ++base) {  // the short tail
    total += checksum_term(static_cast<uint64_t>(words[base]), base);
  }
  return total;
}

using BlockSumsFn = uint64_t (*)(const void*, int64_t, int64_t, int64_t);

template <typename Word>
uint64_t sums_baseline(const void* data, int64_t numel, int64_t first, int64_t last) {
  return block_sums(static_cast<const Word*>(data), numel, first, last);
}

#if defined(__GNUC__) && defined(__x86_64__)
#define VERL_CHECKSUM_X86 1
template <typename Word>
__attribute__((target("avx2"))) uint64_t sums_avx2(const void* data, int64_t numel, int64_t first, int64_t last) {
  return block_sums(static_cast<const Word*>(data), numel, first, last);
}

template <typename Word>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) uint64_t sums_avx512(const void* data, int64_t numel,
                                                                                      int64_t first, int64_t last) {
  return block_sums(static_cast<const Word*>(data), numel, first, last);
}
#endif

template <typename Word>
BlockSumsFn pick() {
#ifdef VERL_CHECKSUM_X86
  static const BlockSumsFn chosen = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq")) {
      return &sums_avx512<Word>;
    }
    if (__builtin_cpu_supports("avx2")) {
      return &sums_avx2<Word>;
    }
    return &sums_baseline<Word>;
  }();
  return chosen;
#else
  return &sums_baseline<Word>;
#endif
}

template <typename Word>
uint64_t checksum_words(const void* data, int64_t numel) {
  const BlockSumsFn sums = pick<Word>();
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  const int64_t tasks = (blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  uint64_t total = 0;
#ifdef _OPENMP
  // Below a few MiB a thread's wake-up costs more than its share (as the copy executor).
  const bool parallel = numel * static_cast<int64_t>(sizeof(Word)) >= 4 * 1024 * 1024 && omp_get_max_threads() > 1;
#pragma omp parallel for reduction(+ : total) schedule(static) if (parallel)
#endif
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t last = (t + 1) * kBlocksPerTask < blocks ? (t + 1) * kBlocksPerTask : blocks;
    total += sums(data, numel, t * kBlocksPerTask, last);
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
