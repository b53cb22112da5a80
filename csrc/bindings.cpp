// The one pybind11/torch binding file of verl._C. Python wrappers live in verl/ops/.
#include <torch/extension.h>

#include "reshard/reshard.h"

#ifdef VERL_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "reshard/reshard_cuda.h"
#endif

namespace {

using verl::reshard::Segment;

const Segment* as_segments(const torch::Tensor& program) {
  TORCH_CHECK(program.device().is_cpu(), "copy program must be a CPU tensor, found ", program.device());
  TORCH_CHECK(program.scalar_type() == torch::kInt64 && program.dim() == 2 && program.size(1) == 6,
              "copy program must be an int64 tensor of shape [n, 6]");
  TORCH_CHECK(program.is_contiguous(), "copy program must be contiguous");
  return reinterpret_cast<const Segment*>(program.data_ptr<int64_t>());
}

// Raises ValueError (TORCH_CHECK_VALUE) naming the first bad segment; returns None for a safe program.
void validate_copy_program(const torch::Tensor& program, int64_t src_numel, int64_t dst_numel, int64_t elem_size,
                           int64_t alignment_bytes) {
  char message[verl::reshard::kMessageBytes];
  const bool ok = verl::reshard::validate_program(as_segments(program), program.size(0), src_numel, dst_numel,
                                                  elem_size, alignment_bytes, message, sizeof(message));
  TORCH_CHECK_VALUE(ok, message);
}

void run_copy_program(const torch::Tensor& src, torch::Tensor& dst, const torch::Tensor& program) {
  TORCH_CHECK(src.dim() == 1 && src.is_contiguous() && dst.dim() == 1 && dst.is_contiguous(),
              "src and dst must be contiguous 1-D tensors");
  TORCH_CHECK(src.element_size() == dst.element_size(), "src and dst must have the same element size");
  TORCH_CHECK(src.device() == dst.device(), "src and dst must be on the same device");
  const Segment* segments = as_segments(program);
  const int64_t n = program.size(0);
  const int64_t elem_size = src.element_size();
  if (src.device().is_cpu()) {
    verl::reshard::run_program_cpu(src.data_ptr(), dst.data_ptr(), segments, n, elem_size);
    return;
  }
#ifdef VERL_WITH_CUDA
  TORCH_CHECK(src.device().is_cuda(), "unsupported device ", src.device());
  const c10::cuda::CUDAGuard guard(src.device());
  auto coalesced = program.clone();
  Segment* coalesced_segments = reinterpret_cast<Segment*>(coalesced.data_ptr<int64_t>());
  for (int64_t i = 0; i < n; ++i) {
    coalesced_segments[i] = verl::reshard::coalesce_rows(coalesced_segments[i]);
  }
  segments = coalesced_segments;
  auto prefix = torch::empty({n + 1}, torch::kInt64);
  verl::reshard::unit_prefix(segments, n, elem_size, verl::reshard::kCudaChunkBytes, prefix.data_ptr<int64_t>());
  bool aligned16 = (reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0);
  for (int64_t i = 0; i < n && aligned16; ++i) {
    aligned16 = verl::reshard::segment_aligned(segments[i], elem_size, 16);
  }
  // Device copies of the program and its unit prefix; the caching allocator keeps them valid for
  // the kernel because both are used on the current stream only.
  auto device_program = coalesced.to(src.device(), /*non_blocking=*/false);
  auto device_prefix = prefix.to(src.device(), /*non_blocking=*/false);
  auto stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err = verl::reshard::launch_program_cuda(
      src.data_ptr(), dst.data_ptr(), reinterpret_cast<const Segment*>(device_program.data_ptr<int64_t>()),
      device_prefix.data_ptr<int64_t>(), n, prefix.data_ptr<int64_t>()[n], elem_size, aligned16, stream.stream());
  TORCH_CHECK(err == cudaSuccess, "copy program kernel launch failed: ", cudaGetErrorString(err));
#else
  TORCH_CHECK(false, "verl._C was built without CUDA; cannot run a copy program on ", src.device());
#endif
}

bool built_with_cuda() {
#ifdef VERL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // torch's Python bindings (tensor casters, dtypes) must exist before ours: `import verl._C` alone works.
  py::module_::import("torch");
  m.doc() = "verl-hpc compiled ops: reshard copy programs (CPU/OpenMP and CUDA)";
  m.def("validate_copy_program", &validate_copy_program, "Raise ValueError naming the first unsafe segment",
        py::arg("program"), py::arg("src_numel"), py::arg("dst_numel"), py::arg("elem_size") = 1,
        py::arg("alignment_bytes") = 0);
  m.def("run_copy_program", &run_copy_program, "Run a validated copy program from src into dst",
        py::arg("src"), py::arg("dst"), py::arg("program"));
  m.def("built_with_cuda", &built_with_cuda, "Whether the CUDA executor was compiled in");
  m.def("cpu_num_threads", &verl::reshard::cpu_num_threads, "OpenMP threads of the CPU executor");
  m.attr("CPU_CHUNK_BYTES") = verl::reshard::kCpuChunkBytes;
  m.attr("CUDA_CHUNK_BYTES") = verl::reshard::kCudaChunkBytes;
}
