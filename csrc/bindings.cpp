// The one pybind11/torch binding file of verl._C. Python wrappers live in verl/ops/.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "collectives/shm_group.h"
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

// The cross-pool sync's bucket checksum (reshard/checksum.h) of a contiguous tensor's elements.
uint64_t checksum(const torch::Tensor& data) {
  TORCH_CHECK(data.is_contiguous(), "checksum: expected a contiguous tensor");
  const int64_t elem_size = data.element_size();
  TORCH_CHECK(elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8,
              "checksum: expected elements of 1, 2, 4 or 8 bytes, found ", elem_size);
  if (data.device().is_cpu()) {
    return verl::reshard::checksum_cpu(data.data_ptr(), data.numel(), elem_size);
  }
#ifdef VERL_WITH_CUDA
  TORCH_CHECK(data.device().is_cuda(), "unsupported device ", data.device());
  const c10::cuda::CUDAGuard guard(data.device());
  auto out = torch::empty({1}, data.options().dtype(torch::kInt64));
  cudaError_t err = verl::reshard::launch_checksum_cuda(data.data_ptr(), data.numel(), elem_size,
                                                        reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>()),
                                                        at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "checksum kernel launch failed: ", cudaGetErrorString(err));
  return static_cast<uint64_t>(out.item<int64_t>());
#else
  TORCH_CHECK(false, "verl._C was built without CUDA; cannot checksum a tensor on ", data.device());
#endif
}

bool built_with_cuda() {
#ifdef VERL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// All-reduce of a contiguous CPU tensor through a ShmGroup, chunk by chunk: copy in, one rendezvous,
// then every rank reduces all slots in rank order into its own tensor (identical results on all ranks).
class ShmCollectives {
  static void check_cpu_contiguous(const torch::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "shm ", what, ": expected a contiguous CPU tensor");
  }
  static void check_op(const std::string& op) {
    TORCH_CHECK(op == "sum" || op == "max" || op == "min", "shm collective: expected op sum, max or min, found ", op);
  }
  // out = op over the rows of `rows` ([world, n]), added in rank order on every rank.
  static void reduce_rows(torch::Tensor& out, const torch::Tensor& rows, const std::string& op) {
    if (op == "sum") {
      if (rows.size(0) == 2) {
        at::add_out(out, rows[0], rows[1]);
      } else {
        at::sum_out(out, rows, {0});
      }
    } else if (op == "max") {
      at::amax_out(out, rows, {0});
    } else {
      at::amin_out(out, rows, {0});
    }
  }

 public:
  ShmCollectives(const std::string& name, int64_t rank, int64_t world, int64_t slot_bytes, bool create)
      : group_(name, static_cast<int>(rank), static_cast<int>(world), static_cast<std::size_t>(slot_bytes), create) {}

  void unlink() { group_.unlink(); }
  int64_t world() const { return group_.world(); }

  void all_reduce(torch::Tensor& tensor, const std::string& op, double timeout_s) {
    check_cpu_contiguous(tensor, "all_reduce");
    check_op(op);
    const py::gil_scoped_release no_gil;
    auto flat = tensor.view({-1});
    const int64_t elem = tensor.element_size();
    const int64_t slot_elems = static_cast<int64_t>(group_.slot_bytes()) / elem;
    const int64_t world = group_.world();
    for (int64_t offset = 0; offset < flat.numel(); offset += slot_elems) {
      const int64_t n = std::min(slot_elems, flat.numel() - offset);
      auto chunk = flat.narrow(0, offset, n);
      std::memcpy(group_.my_slot(), chunk.data_ptr(), static_cast<std::size_t>(n * elem));
      group_.arrive_and_wait(timeout_s);
      // The current set's slots are evenly spaced: view them as one [world, n] tensor.
      auto slots = torch::from_blob(const_cast<void*>(group_.slot_of(0)), {world, n}, {slot_elems, 1}, tensor.options());
      reduce_rows(chunk, slots, op);
      group_.finish();
    }
  }

  // output [world * n] = every rank's input [n], in rank order.
  void all_gather(torch::Tensor& output, const torch::Tensor& input, double timeout_s) {
    check_cpu_contiguous(output, "all_gather_into_tensor");
    check_cpu_contiguous(input, "all_gather_into_tensor");
    const int64_t world = group_.world();
    TORCH_CHECK(output.scalar_type() == input.scalar_type() && output.numel() == world * input.numel(),
                "shm all_gather_into_tensor: expected an output of ", world, " x ", input.numel(), " elements, found ",
                output.numel());
    const py::gil_scoped_release no_gil;
    const auto in = input.view({-1});
    auto out = output.view({world, -1});
    const int64_t elem = input.element_size();
    const int64_t slot_elems = static_cast<int64_t>(group_.slot_bytes()) / elem;
    for (int64_t offset = 0; offset < in.numel(); offset += slot_elems) {
      const int64_t n = std::min(slot_elems, in.numel() - offset);
      std::memcpy(group_.my_slot(), in.narrow(0, offset, n).data_ptr(), static_cast<std::size_t>(n * elem));
      group_.arrive_and_wait(timeout_s);
      auto slots = torch::from_blob(const_cast<void*>(group_.slot_of(0)), {world, n}, {slot_elems, 1}, input.options());
      out.narrow(1, offset, n).copy_(slots);
      group_.finish();
    }
  }

  // output [n] = the reduction over ranks of their input[rank * n : (rank + 1) * n].
  void reduce_scatter(torch::Tensor& output, const torch::Tensor& input, const std::string& op, double timeout_s) {
    check_cpu_contiguous(output, "reduce_scatter_tensor");
    check_cpu_contiguous(input, "reduce_scatter_tensor");
    check_op(op);
    const int64_t world = group_.world();
    TORCH_CHECK(output.scalar_type() == input.scalar_type() && input.numel() == world * output.numel(),
                "shm reduce_scatter_tensor: expected an input of ", world, " x ", output.numel(), " elements, found ",
                input.numel());
    const py::gil_scoped_release no_gil;
    const auto in = input.view({world, -1});
    auto out = output.view({-1});
    const int64_t elem = input.element_size();
    const int64_t slot_elems = static_cast<int64_t>(group_.slot_bytes()) / elem;
    const int64_t per_rank = slot_elems / world;  // a chunk carries `per_rank` elements for every rank
    TORCH_CHECK(per_rank > 0, "shm reduce_scatter_tensor: slots too small for ", world, " ranks");
    const int64_t rank = group_.rank();
    for (int64_t offset = 0; offset < out.numel(); offset += per_rank) {
      const int64_t n = std::min(per_rank, out.numel() - offset);
      auto mine = torch::from_blob(group_.my_slot(), {world, n}, input.options());
      mine.copy_(in.narrow(1, offset, n));
      group_.arrive_and_wait(timeout_s);
      // Rank r's slot holds [world, n]: the rows for this rank sit at r * slot_elems + rank * n.
      auto rows = torch::from_blob(static_cast<char*>(const_cast<void*>(group_.slot_of(0))) + rank * n * elem,
                                   {world, n}, {slot_elems, 1}, input.options());
      auto chunk = out.narrow(0, offset, n);
      reduce_rows(chunk, rows, op);
      group_.finish();
    }
  }

 private:
  verl::collectives::ShmGroup group_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // torch's Python bindings (tensor casters, dtypes) must exist before ours: `import verl._C` alone works.
  py::module_::import("torch");
  m.doc() = "verl-hpc compiled ops: reshard copy programs (CPU/OpenMP and CUDA), shared-memory all-reduce";
  m.def("validate_copy_program", &validate_copy_program, "Raise ValueError naming the first unsafe segment",
        py::arg("program"), py::arg("src_numel"), py::arg("dst_numel"), py::arg("elem_size") = 1,
        py::arg("alignment_bytes") = 0);
  m.def("run_copy_program", &run_copy_program, "Run a validated copy program from src into dst",
        py::arg("src"), py::arg("dst"), py::arg("program"));
  m.def("checksum", &checksum, "sum_i word_i * (2i + 1) mod 2^64 over a contiguous tensor's elements",
        py::arg("data"));
  m.def("built_with_cuda", &built_with_cuda, "Whether the CUDA executor was compiled in");
  m.def("cpu_num_threads", &verl::reshard::cpu_num_threads, "OpenMP threads of the CPU executor");
  m.attr("CPU_CHUNK_BYTES") = verl::reshard::kCpuChunkBytes;
  py::class_<ShmCollectives>(m, "ShmCollectives", "All-reduce, all-gather and reduce-scatter over a shared-memory region of one host's ranks")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, bool>(), py::arg("name"), py::arg("rank"),
           py::arg("world"), py::arg("slot_bytes"), py::arg("create"))
      .def("unlink", &ShmCollectives::unlink, "Remove the region's name once every rank opened it")
      .def("world", &ShmCollectives::world, "Ranks in the group")
      .def("all_reduce", &ShmCollectives::all_reduce, "In-place all-reduce (op: sum, max or min)", py::arg("tensor"),
           py::arg("op"), py::arg("timeout_s"))
      .def("all_gather", &ShmCollectives::all_gather, "output [world * n] = every rank's input [n]", py::arg("output"),
           py::arg("input"), py::arg("timeout_s"))
      .def("reduce_scatter", &ShmCollectives::reduce_scatter, "output [n] = op over ranks of input[rank * n:]",
           py::arg("output"), py::arg("input"), py::arg("op"), py::arg("timeout_s"));
  m.attr("CUDA_CHUNK_BYTES") = verl::reshard::kCudaChunkBytes;
}
