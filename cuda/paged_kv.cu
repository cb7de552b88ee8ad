// Paged-KV row copies between a layer's pool and a contiguous buffer, for CUDA devices.
//
// A layer's pool is `[2 (K,V), num_slots, row]` and a contiguous buffer `[2, n, row]`, where a
// row is one slot's `num_kv_heads * head_dim` elements (bf16, fp16 or fp32). Row i of the buffer
// belongs to slot slots[i]. Only bytes move, so one kernel serves every dtype: it copies rows in
// the widest vector (16, 8, 4 or 2 bytes) that the row size, both bases and both K->V strides
// allow. The launchers take raw pointers and no PyTorch types, so this file also builds alone
// (`nvcc -arch=sm_90 -c paged_kv.cu`); paged_kv_ops.cpp checks tensors and calls them.
#include <cstdint>
#include <cuda_runtime.h>

#include "paged_kv.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

struct alignas(8) Vec8 { uint32_t a, b; };

// Row i of the buffer is pool row slots[i], for K (kv 0) and V (kv 1); strides in bytes.
struct Rows {
  char* pool;
  int64_t pool_kv_stride;
  char* buf;
  int64_t buf_kv_stride;
  const int64_t* slots;
  int64_t n;
  int64_t row_bytes;
};

// One work item per (K|V, row, vector): a grid-stride loop over all of them. kScatter writes
// the pool rows from the buffer; otherwise the buffer rows are read from the pool.
template <typename V, bool kScatter>
__global__ void copy_rows(Rows r) {
  const int64_t per_row = r.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t per_kv = r.n * per_row;
  const int64_t total = 2 * per_kv;
  for (int64_t w = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; w < total;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t kv = w / per_kv;
    const int64_t rest = w - kv * per_kv;
    const int64_t i = rest / per_row;
    const int64_t v = rest - i * per_row;
    V* pool_row = reinterpret_cast<V*>(r.pool + kv * r.pool_kv_stride + r.slots[i] * r.row_bytes);
    V* buf_row = reinterpret_cast<V*>(r.buf + kv * r.buf_kv_stride + i * r.row_bytes);
    if (kScatter) {
      pool_row[v] = buf_row[v];
    } else {
      buf_row[v] = pool_row[v];
    }
  }
}

template <typename V, bool kScatter>
cudaError_t launch_with(const Rows& r, cudaStream_t stream) {
  const int64_t items = 2 * r.n * (r.row_bytes / static_cast<int64_t>(sizeof(V)));
  const int64_t wanted = (items + kThreads - 1) / kThreads;
  copy_rows<V, kScatter><<<static_cast<unsigned>(wanted < kMaxBlocks ? wanted : kMaxBlocks), kThreads, 0, stream>>>(r);
  return cudaGetLastError();
}

// The widest vector that the row size, both bases and both K->V strides are multiples of.
template <bool kScatter>
cudaError_t launch(const Rows& r, cudaStream_t stream) {
  if (r.n == 0 || r.row_bytes == 0) return cudaSuccess;
  const uint64_t bits = reinterpret_cast<uintptr_t>(r.pool) | reinterpret_cast<uintptr_t>(r.buf) |
                        static_cast<uint64_t>(r.pool_kv_stride) | static_cast<uint64_t>(r.buf_kv_stride) |
                        static_cast<uint64_t>(r.row_bytes);
  if (bits % 16 == 0) return launch_with<int4, kScatter>(r, stream);
  if (bits % 8 == 0) return launch_with<Vec8, kScatter>(r, stream);
  if (bits % 4 == 0) return launch_with<uint32_t, kScatter>(r, stream);
  return launch_with<uint16_t, kScatter>(r, stream);
}

}  // namespace

cudaError_t duet_scatter_rows(void* pool, int64_t pool_kv_stride, const void* src, int64_t src_kv_stride,
                              const int64_t* slots, int64_t n, int64_t row_bytes, cudaStream_t stream) {
  const Rows r{static_cast<char*>(pool), pool_kv_stride, const_cast<char*>(static_cast<const char*>(src)),
               src_kv_stride, slots, n, row_bytes};
  return launch<true>(r, stream);
}

cudaError_t duet_gather_rows(const void* pool, int64_t pool_kv_stride, void* dst, int64_t dst_kv_stride,
                             const int64_t* slots, int64_t n, int64_t row_bytes, cudaStream_t stream) {
  const Rows r{const_cast<char*>(static_cast<const char*>(pool)), pool_kv_stride, static_cast<char*>(dst),
               dst_kv_stride, slots, n, row_bytes};
  return launch<false>(r, stream);
}
