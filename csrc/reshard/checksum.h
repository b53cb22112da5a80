// Bucket checksums of the cross-pool weight sync: the math shared by the CPU and CUDA reductions.
//
// checksum(x) = sum_i word_i * (2i + 1)  (mod 2^64), where word_i is element i's bits read as an
// unsigned integer of the element size (1, 2, 4 or 8 bytes). Addition mod 2^64 is
// associative and commutative, so any split over threads or blocks gives the same value; the odd
// position weight makes it order-sensitive (a swapped or shifted block changes it), and a change
// to one element's bits always changes it (an odd weight is invertible mod 2^64).
#pragma once

#include <cstdint>

#include "copy_program.h"  // VERL_HD

namespace verl {
namespace reshard {

VERL_HD uint64_t checksum_term(uint64_t word, int64_t index) {
  return word * (2 * static_cast<uint64_t>(index) + 1);
}

// Element i's bits as an unsigned integer: Word is the unsigned type of the element size.
template <typename Word>
VERL_HD uint64_t word_at(const void* data, int64_t index) {
  return static_cast<uint64_t>(static_cast<const Word*>(data)[index]);
}

}  // namespace reshard
}  // namespace verl
