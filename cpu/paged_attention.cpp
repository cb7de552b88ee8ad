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
//
// Work items are (sequence, block of queries, part of the context): a context longer than
// kKeyPart keys is attended in parts on any threads and the parts merged in key order, so
// a single decoding sequence of a long context uses every thread, while the split depends on
// the context alone (a row's result never depends on its batch or the thread count).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryBlock = 4;  // queries that share one pass over the keys
constexpr int64_t kKeyBlock = 64;  // keys scored before their values are accumulated
constexpr int64_t kScoreBlock = 16;  // keys scored together in vdpbf16ps (one vector of scores)
// Keys per work item: a long context is split into parts of this many keys, each attended on
// its own (running max, sum and weighted values), then merged in order. The split depends on the
// context length only, never on the batch or the thread count, so a row's result stays the same
// whatever runs beside it; it lets one decoding sequence use every thread.
constexpr int64_t kKeyPart = 256;
constexpr int64_t kPrefetch = 4;  // rows ahead to prefetch: slots are scattered over pages

// Queries [first, end) of a sequence, every head, over keys [key_begin, key_end): one of `parts`.
struct Item {
  int64_t seq, first, end, key_begin, key_end, parts;
  int64_t partial;  // -1: the only part, written to out; else its index in the partial states
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

// exp(x) for x <= 0 (a score minus its row's max), 0 below -87 (exp(-inf): a key not attended).
// Written to vectorize inside `omp simd` loops, where std::exp stays a scalar call per key
// (without -ffast-math): 2^n by the exponent bits, exp of the remainder |r| <= ln2/2 by its
// Taylor series to r^6 (relative error 1.2e-7, about one float ulp).
inline float exp_nonpositive(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;  // ln 2 in two parts
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
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
// The 16 lane sums of v[0..16) as one vector (lane t: the sum of v[t]): pairs of vectors are
// interleaved and added, halving their count at each level, in 45 instructions where 16
// separate lane reductions take about 130.
inline __m512 sum16(__m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// scores[jj] = q . k_rows[jj] for the nk <= 16 keys of a block, bfloat16 rows of HD (a multiple
// of 32) meeting in vdpbf16ps as they lie: pairs multiplied exactly, summed in float32.
template <int64_t HD>
inline void score_block(const c10::BFloat16* q, const c10::BFloat16* const* k_rows, int64_t nk, float* scores) {
  __m512bh qv[HD / 32];
  __m512 acc[kScoreBlock];
  for (int64_t c = 0; c < HD / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int64_t jj = 0; jj < kScoreBlock; ++jj) {
    acc[jj] = _mm512_setzero_ps();
    if (jj < nk) {
      for (int64_t c = 0; c < HD / 32; ++c)
        acc[jj] = _mm512_dpbf16_ps(acc[jj], qv[c], (__m512bh)_mm512_loadu_si512(k_rows[jj] + 32 * c));
    }
  }
  _mm512_storeu_ps(scores, sum16(acc));
}
#else
constexpr bool kBf16Dot = false;
// Declared only, so the call under `if constexpr (kBf16Dot ...)` names it; never instantiated.
template <int64_t HD>
void score_block(const c10::BFloat16* q, const c10::BFloat16* const* k_rows, int64_t nk, float* scores);
#endif

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
  // The items; a query block of more than one part is a split, merged after all items ran.
  std::vector<Item> items;
  std::vector<int64_t> splits;  // the first item of each split
  int64_t partials = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t num_new = sq[4 * b + 1], ctx = sq[4 * b + 3];
    for (int64_t i = 0; i < num_new; i += kQueryBlock) {
      const int64_t end = std::min(i + kQueryBlock, num_new), keys_end = ctx - num_new + end;
      const int64_t parts = (keys_end + kKeyPart - 1) / kKeyPart;
      if (parts > 1) splits.push_back(static_cast<int64_t>(items.size()));
      for (int64_t p = 0; p < parts; ++p) {
        items.push_back({b, i, end, p * kKeyPart, std::min((p + 1) * kKeyPart, keys_end), parts,
                         parts > 1 ? partials++ : -1});
      }
    }
  }
  const T* qd = q.data_ptr<T>();
  const T* kd = keys.data_ptr<T>();
  const T* vd = values.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t row = kv_heads * hd;  // elements per slot
  // A part's state, per (query, head) row r = query * heads + head: the running max score, the
  // sum of exp(score - max), and the weighted sum of values (hd floats).
  const int64_t state_row = 2 + hd, state_size = kQueryBlock * heads * state_row;
  std::vector<float> partial_states(partials * state_size);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    // One pass over the part's keys in blocks, with a running max and sum per row (online
    // softmax): each key and value row is read once, while its block is in cache.
    std::vector<float> scores(kQueryBlock * heads * kKeyBlock), own_state(state_size), qf(hd), vf(kKeyBlock * row);
    std::vector<const T*> k_rows(kv_heads * kKeyBlock);  // [kv head][key of the block]
    const float* v_rows[kKeyBlock];
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const int64_t* s = sq + 4 * item.seq;
      const int64_t q_row = s[0], num_new = s[1], ctx = s[3];
      const int64_t* ctx_slots = slot + s[2];
      const bool* mask = mat[item.seq] < 0 ? nullptr : mask_data + mat[item.seq];
      const int64_t rows = (item.end - item.first) * heads;
      float* state = item.partial < 0 ? own_state.data() : partial_states.data() + item.partial * state_size;
      for (int64_t r = 0; r < rows; ++r) {
        state[r * state_row] = kNegInf;
        std::fill(state + r * state_row + 1, state + (r + 1) * state_row, 0.f);
      }
      // Query i attends context positions up to ctx - num_new + i (and the mask's, if any):
      // only a block reaching past the first query's last position needs masking.
      const int64_t first_limit = ctx - num_new + item.first;
      for (int64_t j0 = item.key_begin; j0 < item.key_end; j0 += kKeyBlock) {
        const int64_t nk = std::min(kKeyBlock, item.key_end - j0);
        for (int64_t jj = 0; jj < nk; ++jj) {
          if (j0 + jj + kPrefetch < item.key_end) {
            const int64_t ahead = ctx_slots[j0 + jj + kPrefetch] * row;
            for (int64_t off = 0; off < row; off += kLine) {
              __builtin_prefetch(kd + ahead + off);
              __builtin_prefetch(vd + ahead + off);
            }
          }
          for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
            k_rows[kvh * kKeyBlock + jj] = kd + ctx_slots[j0 + jj] * row + kvh * hd;
        }
        const bool masked = mask || j0 + nk - 1 > first_limit;
        for (int64_t i = item.first, r = 0; i < item.end; ++i) {
          for (int64_t h = 0; h < heads; ++h, ++r) {
            const T* q_head = qd + ((q_row + i) * heads + h) * hd;
            const T* const* k_block = k_rows.data() + h / group * kKeyBlock;
            float* sc = scores.data() + r * kKeyBlock;
            // bfloat16 rows (head dims of 32s) meet in vdpbf16ps as they lie; others are widened.
            if constexpr (kBf16Dot && std::is_same_v<T, c10::BFloat16> && HD > 0 && HD % 32 == 0) {
              for (int64_t j = 0; j < nk; j += kScoreBlock)
                score_block<HD>(q_head, k_block + j, std::min(kScoreBlock, nk - j), sc + j);
            } else {
              const float* qf_head = widen(q_head, qf.data(), hd);
              for (int64_t jj = 0; jj < nk; ++jj) sc[jj] = dot(qf_head, widen(k_block[jj], vf.data(), hd), hd);
            }
            for (int64_t jj = 0; jj < nk; ++jj) {
              const int64_t j = j0 + jj;
              const bool attends = !masked || (j <= ctx - num_new + i && (!mask || mask[i * ctx + j]));
              sc[jj] = attends ? fscale * sc[jj] : kNegInf;
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* sc = scores.data() + r * kKeyBlock;
          float* st = state + r * state_row;
          float m = st[0];
#pragma omp simd reduction(max : m)
          for (int64_t jj = 0; jj < nk; ++jj) m = std::max(m, sc[jj]);
          if (m == kNegInf) {
            for (int64_t jj = 0; jj < nk; ++jj) sc[jj] = 0.f;
            continue;  // nothing attended yet
          }
          const float rescale = exp_nonpositive(st[0] - m);  // 0 when the max was -inf
          if (rescale != 1.f) {
            for (int64_t d = 0; d < hd; ++d) st[2 + d] *= rescale;
          }
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t jj = 0; jj < nk; ++jj) {
            sc[jj] = exp_nonpositive(sc[jj] - m);  // 0 for keys not attended
            total += sc[jj];
          }
          st[0] = m;
          st[1] = st[1] * rescale + total;
        }
        // Values: the block's rows widened once, then each row sums over the block into an
        // accumulator the compiler keeps in registers (HD known), stored once per block.
        for (int64_t jj = 0; jj < nk; ++jj)
          v_rows[jj] = widen(vd + ctx_slots[j0 + jj] * row, vf.data() + jj * row, row);
        for (int64_t r = 0, h = 0; r < rows; ++r, h = h + 1 == heads ? 0 : h + 1) {
          const float* sc = scores.data() + r * kKeyBlock;
          const int64_t kv_offset = h / group * hd;
          float a[HD > 0 ? HD : 1];
          float* out_row = state + r * state_row + 2;
          float* sum_into = HD > 0 ? a : out_row;
          if constexpr (HD > 0) {
            for (int64_t d = 0; d < HD; ++d) a[d] = out_row[d];
          }
          for (int64_t jj = 0; jj < nk; ++jj) {
            if (sc[jj] != 0.f) {
              const float p = sc[jj], *v = v_rows[jj] + kv_offset;
#pragma omp simd
              for (int64_t d = 0; d < hd; ++d) sum_into[d] += p * v[d];
            }
          }
          if constexpr (HD > 0) {
            for (int64_t d = 0; d < HD; ++d) out_row[d] = a[d];
          }
        }
      }
      if (item.partial < 0) {
        T* o = od + (q_row + item.first) * heads * hd;  // the item's rows, in order
        for (int64_t r = 0; r < rows; ++r) {
          const float* st = state + r * state_row;
          const float inv = 1.f / st[1];  // > 0: every query attends at least itself
          for (int64_t d = 0; d < hd; ++d) o[r * hd + d] = static_cast<T>(st[2 + d] * inv);
        }
      }
    }
  });
  // Merge the parts of each split, in key order: each part's sums rescaled to the largest max.
  at::parallel_for(0, static_cast<int64_t>(splits.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hd);
    for (int64_t sp = begin; sp < end; ++sp) {
      const Item& first = items[splits[sp]];
      const float* part0 = partial_states.data() + first.partial * state_size;
      T* o = od + (sq[4 * first.seq] + first.first) * heads * hd;
      for (int64_t r = 0; r < (first.end - first.first) * heads; ++r) {
        float m = kNegInf;
        for (int64_t p = 0; p < first.parts; ++p) m = std::max(m, part0[p * state_size + r * state_row]);
        float total = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = 0; p < first.parts; ++p) {
          const float* st = part0 + p * state_size + r * state_row;
          if (st[0] == kNegInf) continue;  // a part this row attends nothing of
          const float w = exp_nonpositive(st[0] - m);
          total += st[1] * w;
          for (int64_t d = 0; d < hd; ++d) acc[d] += st[2 + d] * w;
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < hd; ++d) o[r * hd + d] = static_cast<T>(acc[d] * inv);
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
