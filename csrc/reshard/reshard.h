// Host-side API of the reshard copy kernels (no torch dependency: the C++ tests and the CMake
// build use it directly; csrc/bindings.cpp adapts torch tensors to it).
#pragma once

#include <cstdint>

#include "copy_program.h"

namespace verl {
namespace reshard {

// Units are row chunks of at most this many bytes (see copy_program.h).
constexpr int64_t kCpuChunkBytes = 256 * 1024;
constexpr int64_t kCudaChunkBytes = 64 * 1024;

// Size of the message buffer validate_program fills (one line; longer messages are truncated).
constexpr int64_t kMessageBytes = 512;

// Returns true when the program is safe on buffers of src_numel / dst_numel elements; otherwise
// writes one NUL-terminated line naming the first offending segment into message[0, capacity) and
// returns false. Checks: non-negative fields, reads and writes in bounds, no destination byte
// written twice, and (alignment_bytes > 0) the caller's claim that every row starts and ends on an
// alignment_bytes boundary. Plain C types only at this boundary: no libstdc++ type crosses into
// the binding, so an error path behaves the same whichever compiler built either side.
bool validate_program(const Segment* segments, int64_t num_segments, int64_t src_numel, int64_t dst_numel,
                      int64_t elem_size, int64_t alignment_bytes, char* message, int64_t capacity);

// Exclusive prefix sum of units per segment into out[0, num_segments] (num_segments + 1 entries).
void unit_prefix(const Segment* segments, int64_t num_segments, int64_t elem_size, int64_t chunk_bytes,
                 int64_t* out);

// Runs a validated program on host memory, spreading units over OpenMP threads.
void run_program_cpu(const void* src, void* dst, const Segment* segments, int64_t num_segments,
                     int64_t elem_size);

// Bucket checksum of numel elements of elem_size bytes (checksum.h), over OpenMP threads.
uint64_t checksum_cpu(const void* data, int64_t numel, int64_t elem_size);

// Number of OpenMP threads the CPU executor uses.
int cpu_num_threads();

}  // namespace reshard
}  // namespace verl
