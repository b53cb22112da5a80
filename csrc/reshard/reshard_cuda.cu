// CUDA executor of copy programs: one launch per program, blocks grid-stride over units (row
// chunks, see copy_program.h); the threads of a block copy one unit with 16-byte vectors when the
// whole program is 16-byte aligned, otherwise with a 16-byte body and a byte-wise head/tail.
#include <cuda_runtime.h>

#include "reshard.h"
#include "reshard_cuda.h"

namespace verl {
namespace reshard {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void copy_bytes(const char* __restrict__ src, char* __restrict__ dst, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    dst[i] = src[i];
  }
}

__device__ __forceinline__ void copy_vec16(const char* __restrict__ src, char* __restrict__ dst, int64_t n) {
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  const int64_t vecs = n / 16;
  for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
    d[i] = s[i];
  }
}

template <bool kAligned16>
__global__ void copy_program_kernel(const char* __restrict__ src, char* __restrict__ dst,
                                    const Segment* __restrict__ segments, const int64_t* __restrict__ unit_begin,
                                    int64_t num_segments, int64_t total_units, int64_t elem_size) {
  for (int64_t unit = blockIdx.x; unit < total_units; unit += gridDim.x) {
    const int64_t seg = find_segment(unit_begin, num_segments, unit);
    const UnitCopy u = unit_copy(segments[seg], unit - unit_begin[seg], elem_size, kCudaChunkBytes);
    const char* s = src + u.src_byte;
    char* d = dst + u.dst_byte;
    if (kAligned16) {
      copy_vec16(s, d, u.nbytes);
      continue;
    }
    // Vectorise the middle when src and dst share their misalignment; bytes for the rest.
    const int64_t mis_s = reinterpret_cast<uintptr_t>(s) & 15;
    const int64_t mis_d = reinterpret_cast<uintptr_t>(d) & 15;
    if (mis_s == mis_d && u.nbytes >= 32) {
      const int64_t head = (16 - mis_s) & 15;
      const int64_t body = (u.nbytes - head) & ~int64_t(15);
      copy_bytes(s, d, head);
      copy_vec16(s + head, d + head, body);
      copy_bytes(s + head + body, d + head + body, u.nbytes - head - body);
    } else {
      copy_bytes(s, d, u.nbytes);
    }
  }
}

}  // namespace

cudaError_t launch_program_cuda(const void* src, void* dst, const Segment* device_segments,
                                const int64_t* device_unit_begin, int64_t num_segments,
                                int64_t total_units, int64_t elem_size, bool aligned16,
                                cudaStream_t stream) {
  if (total_units == 0) {
    return cudaSuccess;
  }
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t max_blocks = static_cast<int64_t>(sms > 0 ? sms : 80) * 8;
  const int blocks = static_cast<int>(total_units < max_blocks ? total_units : max_blocks);
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  if (aligned16) {
    copy_program_kernel<true><<<blocks, kThreads, 0, stream>>>(s, d, device_segments, device_unit_begin,
                                                               num_segments, total_units, elem_size);
  } else {
    copy_program_kernel<false><<<blocks, kThreads, 0, stream>>>(s, d, device_segments, device_unit_begin,
                                                                num_segments, total_units, elem_size);
  }
  return cudaGetLastError();
}

}  // namespace reshard
}  // namespace verl
