// CUDA executor test: random programs on the device equal the CPU executor byte for byte.
// Exits 77 (ctest "skipped") when no CUDA device is present, as on CPU-only CI machines.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "reshard/reshard.h"
#include "reshard/reshard_cuda.h"

using verl::reshard::Segment;

#define CHECK_CUDA(x)                                                          \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e));      \
      return 1;                                                                \
    }                                                                          \
  } while (0)

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipping\n");
    return 77;
  }
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t es = int64_t(1) << (trial % 3);  // 1, 2, 4 bytes
    const int64_t n = 1 << 20;
    std::vector<Segment> prog;
    int64_t cursor = 0;
    while (true) {
      Segment s{};
      s.rows = 1 + rng() % 8;
      s.row_elems = 1 + rng() % ((trial % 5 == 0) ? 40000 : 300);
      s.dst_stride = s.row_elems + rng() % 5;
      s.src_stride = rng() % (2 * s.row_elems + 1);
      s.dst_offset = cursor + rng() % 5;
      const int64_t end = s.dst_offset + (s.rows - 1) * s.dst_stride + s.row_elems;
      const int64_t span = (s.rows - 1) * s.src_stride + s.row_elems;
      if (end > n || span > n) break;
      s.src_offset = rng() % (n - span + 1);
      cursor = end;
      prog.push_back(s);
    }
    char why[verl::reshard::kMessageBytes];
    if (!verl::reshard::validate_program(prog.data(), prog.size(), n, n, es, 0, why, sizeof(why))) return 1;
    std::vector<uint8_t> src(n * es), want(n * es, 0x5A), got(n * es);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    verl::reshard::run_program_cpu(src.data(), want.data(), prog.data(), prog.size(), es);
    for (auto& s : prog) s = verl::reshard::coalesce_rows(s);
    std::vector<int64_t> prefix(prog.size() + 1);
    verl::reshard::unit_prefix(prog.data(), prog.size(), es, verl::reshard::kCudaChunkBytes, prefix.data());
    void *d_src, *d_dst, *d_prog, *d_prefix;
    CHECK_CUDA(cudaMalloc(&d_src, src.size()));
    CHECK_CUDA(cudaMalloc(&d_dst, src.size()));
    CHECK_CUDA(cudaMalloc(&d_prog, prog.size() * sizeof(Segment)));
    CHECK_CUDA(cudaMalloc(&d_prefix, prefix.size() * sizeof(int64_t)));
    CHECK_CUDA(cudaMemcpy(d_src, src.data(), src.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(d_dst, 0x5A, src.size()));
    CHECK_CUDA(cudaMemcpy(d_prog, prog.data(), prog.size() * sizeof(Segment), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_prefix, prefix.data(), prefix.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
    bool aligned = true;
    for (const auto& s : prog) aligned = aligned && verl::reshard::segment_aligned(s, es, 16);
    CHECK_CUDA(verl::reshard::launch_program_cuda(d_src, d_dst, static_cast<Segment*>(d_prog),
                                                  static_cast<int64_t*>(d_prefix), prog.size(), prefix.back(), es,
                                                  aligned, nullptr));
    CHECK_CUDA(cudaMemcpy(got.data(), d_dst, got.size(), cudaMemcpyDeviceToHost));
    cudaFree(d_src);
    cudaFree(d_dst);
    cudaFree(d_prog);
    cudaFree(d_prefix);
    if (std::memcmp(got.data(), want.data(), got.size()) != 0) {
      std::fprintf(stderr, "trial %d: CUDA result differs from the CPU executor\n", trial);
      return 1;
    }
  }
  std::printf("copy program CUDA tests passed\n");
  return 0;
}
