// PyTorch operators over paged_kv.cu: torch.ops.duet_paged_kv.scatter_to_slots / gather_from_slots.
//
// Shapes (checked by cuda/paged_kv.py before the call, re-checked here for safety):
//   pool_layer_kv [2, num_slots, heads, head_dim], rows contiguous (a layer of the KV pool)
//   buffer        [2, n, heads, head_dim], contiguous
//   slots         [n] int64 on the same device, each in [0, num_slots), distinct
// The kernels run on the caller's current CUDA stream.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "paged_kv.h"

namespace {

void check(const at::Tensor& pool, const at::Tensor& buffer, const at::Tensor& slots) {
  TORCH_CHECK(pool.is_cuda() && buffer.device() == pool.device() && slots.device() == pool.device(),
              "pool, buffer and slots must be on the same CUDA device");
  TORCH_CHECK(pool.dim() == 4 && buffer.dim() == 4 && pool.size(0) == 2 && buffer.size(0) == 2,
              "pool_layer_kv and the buffer must be [2, rows, heads, head_dim]");
  TORCH_CHECK(pool.size(2) == buffer.size(2) && pool.size(3) == buffer.size(3), "row shapes differ");
  TORCH_CHECK(pool.scalar_type() == buffer.scalar_type(), "pool and buffer dtypes differ");
  TORCH_CHECK(pool.stride(3) == 1 && pool.stride(2) == pool.size(3) && pool.stride(1) == pool.size(2) * pool.size(3),
              "pool_layer_kv rows must be contiguous");
  TORCH_CHECK(buffer.is_contiguous(), "the buffer must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == buffer.size(1),
              "slots must be a contiguous 1-D int64 tensor with one entry per buffer row");
}

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "paged KV kernel launch failed: ", cudaGetErrorString(err));
}

// Checks the operands, then has `launcher` (duet_scatter_rows or duet_gather_rows: the same
// arguments, the pool side first) copy rows between the pool layer and `buffer` on the current
// stream of the pool's device.
template <typename Launcher>
void copy_rows(Launcher launcher, const at::Tensor& pool, const at::Tensor& buffer, const at::Tensor& slots) {
  check(pool, buffer, slots);
  const c10::cuda::CUDAGuard guard(pool.device());
  const int64_t es = pool.element_size();
  check_launch(launcher(pool.data_ptr(), pool.stride(0) * es, buffer.data_ptr(), buffer.stride(0) * es,
                        slots.data_ptr<int64_t>(), slots.size(0), pool.stride(1) * es,
                        c10::cuda::getCurrentCUDAStream()));
}

void scatter_to_slots(const at::Tensor& pool, const at::Tensor& src, const at::Tensor& slots) {
  copy_rows(duet_scatter_rows, pool, src, slots);
}

void gather_from_slots(const at::Tensor& pool, const at::Tensor& slots, const at::Tensor& out) {
  copy_rows(duet_gather_rows, pool, out, slots);
}

}  // namespace

TORCH_LIBRARY(duet_paged_kv, m) {
  m.def("scatter_to_slots(Tensor(a!) pool_layer_kv, Tensor src, Tensor slots) -> ()");
  m.def("gather_from_slots(Tensor pool_layer_kv, Tensor slots, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(duet_paged_kv, CUDA, m) {
  m.impl("scatter_to_slots", &scatter_to_slots);
  m.impl("gather_from_slots", &gather_from_slots);
}
