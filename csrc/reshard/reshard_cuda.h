// CUDA executor of copy programs (compiled only where nvcc is present).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "copy_program.h"

namespace verl {
namespace reshard {

// Enqueues one kernel on `stream` that runs the whole program. `device_segments` and
// `device_unit_begin` (num_segments + 1 entries, units of kCudaChunkBytes) live in device memory;
// `aligned16` says every unit's src/dst byte offsets and lengths are multiples of 16 and both base
// pointers are 16-byte aligned, which enables 16-byte vector copies.
cudaError_t launch_program_cuda(const void* src, void* dst, const Segment* device_segments,
                                const int64_t* device_unit_begin, int64_t num_segments,
                                int64_t total_units, int64_t elem_size, bool aligned16,
                                cudaStream_t stream);

// Enqueues the checksum of numel elements of elem_size bytes at `data` (device memory) into
// *device_out (device memory, zeroed first) on `stream`.
cudaError_t launch_checksum_cuda(const void* data, int64_t numel, int64_t elem_size, uint64_t* device_out,
                                 cudaStream_t stream);

}  // namespace reshard
}  // namespace verl
