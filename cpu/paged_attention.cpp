// torch.ops.duet_cpu.paged_attention: attention that reads K/V where they lie in the paged pool.
//
// Shapes (checked by common/model/paged_attention.py before the call, re-checked here):
//   q, out        [T, num_heads, head_dim], contiguous: every sequence's new tokens
//   keys, values  [num_slots, num_kv_heads, head_dim], contiguous: one layer of the pool
//   (all four float32, or all four bfloat16: K/V are read in place, and widened row by row
//   except keys on AVX512-BF16 CPUs, which meet the bf16 queries in vdpbf16ps;
//   scores, softmax and the weighted sum of values accumulate in float32 either way)
//   slots         [C] int64: the context slots of every sequence, concatenated
//   seqs          [B, 4] int64: per sequence (first query row, queries, first entry in slots,
//                 context length); query i of a sequence sits at context position
//                 context_len - queries + i
//   masks         [M] bool: row-major [queries, context_len] masks, concatenated
//   mask_at       [B] int64: where a sequence's mask starts in masks; -1 = causal
// Query head h reads KV head h / (num_heads / num_kv_heads), as transformers' repeat_kv does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryBlock = 4;  // queries that share one pass over the keys
constexpr int64_t kKeyBlock = 64;  // keys scored before their values are accumulated
constexpr int64_t kPrefetch = 4;  // rows ahead to prefetch: slots are scattered over pages

struct Item {
  int64_t seq, first, end;  // queries [first, end) of a sequence, every head
};

// A row of `n` elements as float32: the row itself for float, else widened into `buffer`.
template <typename T>
inline const float* widen(const T* row, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  // A vector multiply-add over d, then one tree reduction of the lanes.
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
// q . k of two bfloat16 rows: vdpbf16ps multiplies pairs exactly and sums in float32, then one
// tree reduction of the lanes; neither row is widened first. n is a multiple of 32.
inline float dot(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n) {
  __m512 s = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 32)
    s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
  return _mm512_reduce_add_ps(s);
}
#else
constexpr bool kBf16Dot = false;
#endif

inline void axpy(float* acc, float p, const float* v, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * v[d];
}

void check(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& out,
           const at::Tensor& slots, const at::Tensor& seqs, const at::Tensor& masks, const at::Tensor& mask_at) {
  for (const at::Tensor* t : {&q, &keys, &values, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == q.scalar_type() && t->is_contiguous() && t->dim() == 3,
                "q, keys, values and out must be contiguous 3-D CPU tensors of one dtype");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "the dtype must be float32 or bfloat16");
  TORCH_CHECK(out.sizes() == q.sizes() && keys.sizes() == values.sizes() && keys.size(2) == q.size(2) &&
                  q.size(1) % keys.size(1) == 0,
              "q/out [T, heads, head_dim] and keys/values [slots, kv_heads, head_dim] do not agree");
  for (const at::Tensor* t : {&slots, &seqs, &mask_at}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "slots, seqs and mask_at must be contiguous int64 CPU tensors");
  }
  TORCH_CHECK(masks.device().is_cpu() && masks.scalar_type() == at::kBool && masks.is_contiguous(),
              "masks must be a contiguous bool CPU tensor");
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 4 && mask_at.numel() == seqs.size(0), "seqs must be [B, 4]");
}

// HD > 0: the head dim known at compile time (64, 128: the inner loops then unroll fully, no
// remainder code); HD == 0: read from q.
template <typename T, int64_t HD>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& out,
            const at::Tensor& slots, const at::Tensor& seqs, const at::Tensor& masks, const at::Tensor& mask_at,
            double scale) {
  const int64_t heads = q.size(1), kv_heads = keys.size(1), hd = HD > 0 ? HD : q.size(2), group = heads / kv_heads;
  const int64_t num_slots = keys.size(0), num_seqs = seqs.size(0);
  const int64_t* sq = seqs.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* mat = mask_at.data_ptr<int64_t>();
  const bool* mask_data = masks.data_ptr<bool>();
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t* s = sq + 4 * b;
    TORCH_CHECK(s[1] >= 1 && s[1] <= s[3] && s[0] >= 0 && s[0] + s[1] <= q.size(0) && s[2] >= 0 &&
                    s[2] + s[3] <= slots.numel(),
                "seqs row ", b, " is out of range");
    TORCH_CHECK(mat[b] < 0 || mat[b] + s[1] * s[3] <= masks.numel(), "mask of sequence ", b, " is out of range");
    for (int64_t j = 0; j < s[3]; ++j) {
      TORCH_CHECK(slot[s[2] + j] >= 0 && slot[s[2] + j] < num_slots, "slot out of range");
    }
  }
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    for (int64_t i = 0; i < sq[4 * b + 1]; i += kQueryBlock) {
      items.push_back({b, i, std::min(i + kQueryBlock, sq[4 * b + 1])});
    }
  }
  const T* qd = q.data_ptr<T>();
  const T* kd = keys.data_ptr<T>();
  const T* vd = values.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t row = kv_heads * hd;  // elements per slot
  // Where query head h's KV head starts in a slot's row, computed once: a division per key and
  // head cost more than the arithmetic it indexes.
  std::vector<int64_t> kv_offset(heads);
  for (int64_t h = 0; h < heads; ++h) kv_offset[h] = h / group * hd;
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    // One pass over the keys in blocks, with a running max and sum per (query, head) row
    // (online softmax): each key and value row is read once, while its block is in cache.
    std::vector<float> scores, acc, maxes, sums, qf(kQueryBlock * heads * hd), kf(row), vf(kKeyBlock * row);
    std::vector<const float*> v_rows(kKeyBlock);
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const int64_t* s = sq + 4 * item.seq;
      const int64_t q_row = s[0], num_new = s[1], ctx = s[3];
      const int64_t* ctx_slots = slot + s[2];
      const bool* mask = mat[item.seq] < 0 ? nullptr : mask_data + mat[item.seq];
      const int64_t nq = item.end - item.first, rows = nq * heads;  // (query, head) pairs
      scores.assign(rows * kKeyBlock, 0.f);
      acc.assign(rows * hd, 0.f);
      maxes.assign(rows, -std::numeric_limits<float>::infinity());
      sums.assign(rows, 0.f);
      // The item's queries as float32: qf + ((i - item.first) * heads + h) * hd.
      const float* queries = widen(qd + (q_row + item.first) * heads * hd, qf.data(), rows * hd);
      // Causal: query i attends context positions up to ctx - num_new + i.
      const int64_t keys_end = ctx - num_new + item.end;
      for (int64_t j0 = 0; j0 < keys_end; j0 += kKeyBlock) {
        const int64_t nk = std::min(kKeyBlock, keys_end - j0);
        for (int64_t jj = 0; jj < nk; ++jj) {
          const int64_t j = j0 + jj;
          if (jj + kPrefetch < nk) {
            for (int64_t off = 0; off < row; off += kLine) {
              __builtin_prefetch(kd + ctx_slots[j + kPrefetch] * row + off);
              __builtin_prefetch(vd + ctx_slots[j + kPrefetch] * row + off);
            }
          }
          // bfloat16 rows (head dims of 32s) meet in vdpbf16ps as they lie; others are widened.
          constexpr bool raw = kBf16Dot && std::is_same_v<T, c10::BFloat16> && HD > 0 && HD % 32 == 0;
          const T* k_row = kd + ctx_slots[j] * row;
          const float* k = raw ? nullptr : widen(k_row, kf.data(), row);
          for (int64_t i = item.first; i < item.end; ++i) {
            const bool attends = j <= ctx - num_new + i && (!mask || mask[i * ctx + j]);
            for (int64_t h = 0; h < heads; ++h) {
              const int64_t r = (i - item.first) * heads + h;
              float score;
              if constexpr (raw) {
                score = dot(qd + ((q_row + i) * heads + h) * hd, k_row + kv_offset[h], hd);
              } else {
                score = dot(queries + r * hd, k + kv_offset[h], hd);
              }
              scores[r * kKeyBlock + jj] = attends ? fscale * score : -std::numeric_limits<float>::infinity();
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* sc = scores.data() + r * kKeyBlock;
          float m = maxes[r];
          for (int64_t jj = 0; jj < nk; ++jj) m = std::max(m, sc[jj]);
          if (m == -std::numeric_limits<float>::infinity()) {
            for (int64_t jj = 0; jj < nk; ++jj) sc[jj] = 0.f;
            continue;  // nothing attended yet
          }
          const float rescale = std::exp(maxes[r] - m);  // 0 when maxes[r] is -inf
          if (rescale != 1.f) {
            float* a = acc.data() + r * hd;
            for (int64_t d = 0; d < hd; ++d) a[d] *= rescale;
          }
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t jj = 0; jj < nk; ++jj) {
            sc[jj] = expf(sc[jj] - m);  // exp(-inf) = 0 for keys not attended
            total += sc[jj];
          }
          total += sums[r] * rescale;
          maxes[r] = m;
          sums[r] = total;
        }
        // Values: the block's rows widened once, then each (query, head) row sums over the block
        // into an accumulator the compiler keeps in registers (HD known), stored once per block.
        for (int64_t jj = 0; jj < nk; ++jj) v_rows[jj] = widen(vd + ctx_slots[j0 + jj] * row, vf.data() + jj * row, row);
        for (int64_t r = 0, h = 0; r < rows; ++r, h = h + 1 == heads ? 0 : h + 1) {
          const float* sc = scores.data() + r * kKeyBlock;
          float a[HD > 0 ? HD : 1];
          float* out_row = acc.data() + r * hd;
          float* sum_into = HD > 0 ? a : out_row;
          if constexpr (HD > 0) {
            for (int64_t d = 0; d < HD; ++d) a[d] = out_row[d];
          }
          for (int64_t jj = 0; jj < nk; ++jj) {
            if (sc[jj] != 0.f) axpy(sum_into, sc[jj], v_rows[jj] + kv_offset[h], hd);
          }
          if constexpr (HD > 0) {
            for (int64_t d = 0; d < HD; ++d) out_row[d] = a[d];
          }
        }
      }
      for (int64_t i = item.first; i < item.end; ++i) {
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t r = (i - item.first) * heads + h;
          T* o = od + ((q_row + i) * heads + h) * hd;
          const float inv = 1.f / sums[r];  // > 0: every query attends at least itself
          for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<T>(acc[r * hd + d] * inv);
        }
      }
    }
  });
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& out,
                       const at::Tensor& slots, const at::Tensor& seqs, const at::Tensor& masks,
                       const at::Tensor& mask_at, double scale) {
  switch (q.size(2)) {
    case 64: return attend<T, 64>(q, keys, values, out, slots, seqs, masks, mask_at, scale);
    case 128: return attend<T, 128>(q, keys, values, out, slots, seqs, masks, mask_at, scale);
    default: return attend<T, 0>(q, keys, values, out, slots, seqs, masks, mask_at, scale);
  }
}

void paged_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& out,
                     const at::Tensor& slots, const at::Tensor& seqs, const at::Tensor& masks,
                     const at::Tensor& mask_at, double scale) {
  check(q, keys, values, out, slots, seqs, masks, mask_at);
  if (q.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<c10::BFloat16>(q, keys, values, out, slots, seqs, masks, mask_at, scale);
  } else {
    dispatch_head_dim<float>(q, keys, values, out, slots, seqs, masks, mask_at, scale);
  }
}

}  // namespace

TORCH_LIBRARY(duet_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor keys, Tensor values, Tensor(a!) out, Tensor slots, Tensor seqs, "
        "Tensor masks, Tensor mask_at, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(duet_cpu, CPU, m) { m.impl("paged_attention", paged_attention); }
