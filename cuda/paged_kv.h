// Launchers of paged_kv.cu (strides and sizes in bytes; slots on the device, in range, distinct).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

// pool rows [kv][slots[i]] <- src rows [kv][i], for kv in {0, 1} and i < n.
cudaError_t duet_scatter_rows(void* pool, int64_t pool_kv_stride, const void* src, int64_t src_kv_stride,
                              const int64_t* slots, int64_t n, int64_t row_bytes, cudaStream_t stream);

// dst rows [kv][i] <- pool rows [kv][slots[i]], for kv in {0, 1} and i < n.
cudaError_t duet_gather_rows(const void* pool, int64_t pool_kv_stride, void* dst, int64_t dst_kv_stride,
                             const int64_t* slots, int64_t n, int64_t row_bytes, cudaStream_t stream);
