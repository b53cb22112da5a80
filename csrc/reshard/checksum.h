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

// A block of elements [base, base + n) whose sums S0 = sum_j word_j and S1 = sum_j word_j * j (j counted
// from the block's start) are known contributes (2 base + 1) S0 + 2 S1: the same terms regrouped, so a
// CPU loop can run on 32-bit block offsets, which vectorise, and still equal the per-element sum.
VERL_HD uint64_t checksum_block(uint64_t base, uint64_t s0, uint64_t s1) {
  return (2 * base + 1) * s0 + 2 * s1;
}

// Element i's bits as an unsigned integer: Word is the unsigned type of the element size.
template <typename Word>
VERL_HD uint64_t word_at(const void* data, int64_t index) {
  return static_cast<uint64_t>(static_cast<const Word*>(data)[index]);
}

}  // namespace reshard
}  // namespace verl
