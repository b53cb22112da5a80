// CUDA checksum of a device buffer (see checksum.h): grid-stride partial sums per thread, a block
// reduction in shared memory, one 64-bit atomic add per block. The sum is mod 2^64, so the
// result does not depend on the grid.
#include <cuda_runtime.h>

#include "checksum.h"
#include "reshard_cuda.h"

namespace verl {
namespace reshard {
namespace {

constexpr int kThreads = 256;

template <typename Word>
__global__ void checksum_kernel(const void* __restrict__ data, int64_t numel, unsigned long long* __restrict__ out) {
  __shared__ unsigned long long partial[kThreads];
  unsigned long long sum = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    sum += checksum_term(word_at<Word>(data, i), i);
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      partial[threadIdx.x] += partial[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicAdd(out, partial[0]);
  }
}

}  // namespace

cudaError_t launch_checksum_cuda(const void* data, int64_t numel, int64_t elem_size, uint64_t* device_out,
                                 cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(device_out, 0, sizeof(uint64_t), stream);
  if (err != cudaSuccess || numel == 0) {
    return err;
  }
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t wanted = (numel + kThreads - 1) / kThreads;
  const int64_t max_blocks = static_cast<int64_t>(sms > 0 ? sms : 80) * 4;
  const int blocks = static_cast<int>(wanted < max_blocks ? wanted : max_blocks);
  unsigned long long* out = reinterpret_cast<unsigned long long*>(device_out);
  switch (elem_size) {
    case 1:
      checksum_kernel<uint8_t><<<blocks, kThreads, 0, stream>>>(data, numel, out);
      break;
    case 2:
      checksum_kernel<uint16_t><<<blocks, kThreads, 0, stream>>>(data, numel, out);
      break;
    case 4:
      checksum_kernel<uint32_t><<<blocks, kThreads, 0, stream>>>(data, numel, out);
      break;
    default:
      checksum_kernel<uint64_t><<<blocks, kThreads, 0, stream>>>(data, numel, out);
  }
  return cudaGetLastError();
}

}  // namespace reshard
}  // namespace verl
